"""DSpark drafter (arXiv 2607.05147): a DFlash backbone that drafts from the anchor slot too, a light
sequential Markov head, and a confidence head.

    U_k, h_k  = the DFlash backbone (dflash.py) over [x_p, mask x (S-1)]: slot k's logits and post-norm
                state; slot k drafts x_{p+1+k} (k = 0 .. S-1, "sample from anchor")
    q_k(v)    = softmax(U_k(v) + (W1[x_{p+k}] W2)(v))       W1 [V, r] by the previous token (x_p the
                anchor, then each drawn draft), W2 [r, Vd]; locally normalized, so q_k is exactly the
                distribution a draft is drawn from and the one rejection sampling is given
    c_k       = sigmoid(w . [h_k ; W1[x_{p+k}]] / T_k)        the chance draft k survives given all
                earlier ones did; T_k from Sequential Temperature Scaling (`calibrate`)

The backbone runs once per step; the Markov head runs left to right as the tokens are drawn (expand.py
asks for each node's children's logits given the node's token), so chains and trees come out of the
same loop as for every other drafter. Weight and config names follow speculators' `dspark` format
(`DSparkSpeculatorConfig`: markov_head.markov_w1 / markov_w2, confidence_head.proj), which vLLM
serves with `"method": "dspark"`; the STS temperatures are verispec's own `confidence_temperatures`.

Why it stays lossless: q_k depends on the context and the tokens drawn before k, never on x_{p+1+k}
itself, and the draft is drawn from exactly q_k; the confidence of node k reads its parent's token
only, so a planner that uses it never admits a token by its own value.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..models.prepack import prepack_head
from ..sequence import Sequence
from . import expand
from .base import Draft, register
from .dflash import DFlashConfig, DFlashDrafter, DFlashModel
from .eagle3 import _check_ints
from .head import CheckpointError, speculators_block


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 256
    confidence_temperatures: list[float] = field(default_factory=list)  # STS, per slot (empty: 1.0)

    @property
    def speculative_tokens(self) -> int:
        return self.block_size  # every slot drafts, the anchor's included

    def to_speculators(self, dtype: str = "bfloat16") -> dict:
        d = super().to_speculators(dtype)
        d.update({"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark", "sample_from_anchor": True,
                  "markov_rank": self.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
                  "confidence_head_with_markov": True})
        if self.confidence_temperatures:
            d["confidence_temperatures"] = list(self.confidence_temperatures)
        d["speculators_config"] = speculators_block(self, "dspark")
        return d

    @classmethod
    def from_speculators(cls, d: dict, where: str = "config.json") -> "DSparkConfig":
        if d.get("speculators_model_type") != "dspark":
            raise CheckpointError(f"{where}: speculators_model_type is {d.get('speculators_model_type')!r}, not 'dspark'")
        if not d.get("sample_from_anchor", True):
            raise CheckpointError(f"{where}: a DSpark checkpoint without sample_from_anchor is not supported")
        if d.get("markov_head_type", "vanilla") != "vanilla":
            raise CheckpointError(f"{where}: markov_head_type {d.get('markov_head_type')!r} is not supported (vanilla only)")
        if not d.get("enable_confidence_head", True) or not d.get("confidence_head_with_markov", True):
            raise CheckpointError(f"{where}: only the confidence head over [h_k; W1[x_k-1]] is supported")
        _check_ints(d, where, "", "markov_rank")
        if d.get("markov_rank", 256) < 1:
            raise CheckpointError(f"{where}: markov_rank must be >= 1 (0 is a plain DFlash drafter)")
        temps = d.get("confidence_temperatures") or []
        if not isinstance(temps, list) or not all(isinstance(t, (int, float)) and t > 0 for t in temps):
            raise CheckpointError(f"{where}: confidence_temperatures must be a list of positive numbers, got {temps!r}")
        base = DFlashConfig.from_speculators({**d, "speculators_model_type": "dflash", "sample_from_anchor": False},
                                             where)
        return cls(**dataclasses.asdict(base), markov_rank=d.get("markov_rank", 256),
                   confidence_temperatures=[float(t) for t in temps])


class MarkovHead(nn.Module):
    """The low-rank bias W1[prev] W2: W1 indexes the target vocabulary, W2 maps to the draft one."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def forward(self, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev_ids [...] -> (bias [..., Vd] fp32, W1[prev] [..., r])."""
        e = self.markov_w1(prev_ids)
        return self.markov_w2(e).float(), e


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1).float()


class DSparkModel(DFlashModel):
    def __init__(self, c: DSparkConfig, embed_weight: torch.Tensor | None = None):
        super().__init__(c, embed_weight)
        self.markov_head = MarkovHead(c.vocab_size, c.draft_vocab_size, c.markov_rank)
        self.confidence_head = ConfidenceHead(c.hidden_size + c.markov_rank)

    def heads(self, h: torch.Tensor, base: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., H] post-norm slot states, base [..., Vd] their logits U, prev_ids [...] the token before
        each slot's draft -> (q logits U + W1[prev] W2 [..., Vd], confidence logits [...] (uncalibrated))."""
        bias, e = self.markov_head(prev_ids)
        conf = self.confidence_head(torch.cat([h, e.to(h.dtype)], -1))
        return base + bias, conf

    def temperatures(self) -> torch.Tensor:
        """[S] the STS temperature of each slot's confidence (1.0 where not calibrated)."""
        t = list(self.config.confidence_temperatures)[: self.config.block_size]
        return torch.tensor(t + [1.0] * (self.config.block_size - len(t)))

    def forward(self, aux, ids, valid, anchors) -> tuple[torch.Tensor, torch.Tensor]:
        """As DFlash's, with the Markov head teacher-forced (slot k's previous token is the data token
        x_{a+k}). Returns (logits [B, A, S, Vd], confidence logits [B, A, S], uncalibrated)."""
        h = self.block_states(aux, ids, valid, anchors)  # [B, A, S, H]
        S, T = self.config.block_size, ids.shape[1]
        prev = ids.gather(1, (anchors[..., None] + torch.arange(S, device=ids.device)).clamp(max=T - 1).flatten(1))
        return self.heads(h, self.head_logits(h), prev.reshape(h.shape[:-1]))

    def config_json(self, dtype_name: str) -> dict:
        return self.config.to_speculators(dtype_name)

    @classmethod
    def claims(cls, d: dict) -> bool:
        return d.get("speculators_model_type") == "dspark"

    @classmethod
    def config_from_json(cls, d: dict, where: str) -> DSparkConfig:
        return DSparkConfig.from_speculators(d, where)


def load_dspark(path: str | Path, target=None, dtype: torch.dtype = torch.float32) -> DSparkModel:
    return DSparkModel.load(path, target, dtype)


class DSparkDrafter(DFlashDrafter):
    """The backbone once per step, then the Markov head token by token (chains or trees)."""

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        m = self.model
        S = m.config.block_size
        idx = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k > 0 and self._ready(s)]
        if not idx:
            return drafts
        run = [seqs[i] for i in idx]
        budgets = [min(ks[i], S) for i in idx]
        h = self.block_states([s.drafter_state.slot for s in run], [len(s.tokens) - 1 for s in run],
                              [s.tokens[-1] for s in run])  # [B, S, H]
        base = m.head_logits(h)  # [B, S, Vd] the backbone's U_k
        temps = m.temperatures()

        def slot(b: int, k: int, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Slot k of sequence b after previous tokens prev [n]: draft-vocabulary logits [n, Vd] and
            calibrated confidence logits [n]."""
            lg, conf = m.heads(h[b, k].expand(len(prev), -1), base[b, k].expand(len(prev), -1), prev.to(self.device))
            return lg, conf / float(temps[k])

        def step(run_nodes, nodes):  # a node at depth d drew its token; its children come from slot d
            return [torch.cat([slot(b, nodes[b][i].depth, torch.tensor([nodes[b][i].token]))[0] for i in r]) if r
                    else None for b, r in enumerate(run_nodes)]

        anchors = [torch.tensor([s.tokens[-1]]) for s in run]
        root = torch.cat([slot(b, 0, anchors[b])[0] for b in range(len(run))])
        out = expand.draft(run, budgets, root, step, self.columns)
        for b, (i, d) in enumerate(zip(idx, out)):
            drafts[i] = _with_confidence(d, lambda k, prev, b=b: slot(b, k, prev)[1], anchors[b])
        return drafts


def _with_confidence(d: Draft, confidence, anchor: torch.Tensor) -> Draft:
    """The draft with each node's feature replaced by its calibrated confidence logit, read from its
    parent's token (never its own), for the adaptive planner. confidence(k, prev [1]) -> [1]."""
    if not d.tokens:
        return d
    parents = d.parents if d.parents is not None else list(range(-1, len(d.tokens) - 1))
    feats = [[float(confidence(dep - 1, anchor if par < 0 else torch.tensor([d.tokens[par]]))[0])]
             for par, dep in zip(parents, d.depths())]
    return dataclasses.replace(d, features=feats)


def is_dspark_dir(path: str) -> bool:
    return DSparkModel.is_checkpoint(path)


def make_dspark_drafter(path: str, target, max_batch: int, max_len: int, dtype, device) -> DSparkDrafter:
    model = load_dspark(path, target, dtype=target.dtype).to(device)
    prepack_head(model)  # bf16 on a CPU with bf16 arithmetic: oneDNN's blocked layout
    model.set_embedding(target.model.embed_tokens.weight)
    return DSparkDrafter(model, target, max_batch, max_len, name=f"dspark:{path}")


@register("dspark", "dspark:DIR (or a bare DIR)", "a DSpark drafter: DFlash backbone + Markov head + confidence head "
          "(speculators format)", detect=lambda p: is_dspark_dir(p))
def _make(arg: str, ctx) -> DSparkDrafter:
    try:
        return make_dspark_drafter(arg, ctx.target, ctx.max_batch, ctx.max_len, ctx.dtype, ctx.device)
    except CheckpointError as e:
        raise ValueError(str(e)) from e


# --------------------------------------------------------------------------------------------
# Sequential Temperature Scaling of the confidences (DSpark §3.2.1)


def expected_calibration_error(pred: torch.Tensor, truth: torch.Tensor, bins: int = 10) -> float:
    """ECE of predicted probabilities pred [N] against 0/1 outcomes truth [N] (equal-width bins)."""
    if pred.numel() == 0:
        return 0.0
    which = (pred * bins).long().clamp(max=bins - 1)
    ece = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            ece += float(sel.float().mean()) * abs(float(pred[sel].mean()) - float(truth[sel].float().mean()))
    return ece


def sequential_temperature_scaling(conf_logits: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor,
                                   grid: torch.Tensor | None = None) -> tuple[list[float], list[float], list[float]]:
    """conf_logits [N, S] raw confidence logits of N held-out blocks, accepted [N, S] whether draft k
    was accepted (with all before it), valid [N, S]. For k = 1..S in order, the temperature T_k (grid
    search) minimizing the ECE of the cumulative product prod_{i<=k} sigmoid(z_i / T_i) against
    accepted[:, k], earlier temperatures fixed. Returns (temperatures, ECE before, ECE after) per k."""
    grid = grid if grid is not None else torch.exp(torch.linspace(math.log(0.05), math.log(20.0), 121))
    S = conf_logits.shape[1]
    temps: list[float] = []
    before, after = [], []
    cum_raw = torch.ones(conf_logits.shape[0])
    cum_cal = torch.ones(conf_logits.shape[0])
    for k in range(S):
        z, ok, y = conf_logits[:, k], valid[:, k], accepted[:, k]
        cum_raw = cum_raw * torch.sigmoid(z)
        before.append(expected_calibration_error(cum_raw[ok], y[ok]))
        best = min(grid.tolist(), key=lambda t: expected_calibration_error((cum_cal * torch.sigmoid(z / t))[ok], y[ok]))
        temps.append(float(best))
        cum_cal = cum_cal * torch.sigmoid(z / best)
        after.append(expected_calibration_error(cum_cal[ok], y[ok]))
    return temps, before, after


__all__ = ["DSparkConfig", "DSparkModel", "DSparkDrafter", "load_dspark", "make_dspark_drafter", "is_dspark_dir",
           "expected_calibration_error", "sequential_temperature_scaling"]
