"""P-EAGLE drafter (parallel EAGLE, arXiv 2602.01469): all K draft tokens from one drafter forward.

It is an EAGLE-3 head (eagle3.py: the same fused target layers, first layer and Llama layers, and
the same speculators weight names) whose depths 2..K do not wait for the tokens drafted before them:

    depth 1   row e-1: concat(embed(x_e), fuse(g_{e-1}))      the last committed token, as EAGLE-3
    depth d   row e+d-2: concat(embed(mask), fuse(mask_hidden)) a learned state, the same for every d
    logits    all K rows in one causal forward; row e-2+d predicts x_{e+d}

`mask_hidden` [1, 1, n*H] is learned and goes through the same fusion (`fc`, `fc_norm`) as the
target states; the mask token is a token of the target's vocabulary (`mask_token_id`), whose frozen
embedding the drafter shares with the target (as every EAGLE-3 head here does). That keeps a
Gemma 3 drafter at a few MB instead of carrying its own 262k-row embedding table (speculators'
P-EAGLE trains the embedding; its config then says `embed_requires_grad: true`).

Why it stays lossless: the depth-d distribution q_d is a function of the committed context only, so
a token drawn from q_d with the request's generator is verified with q_d as Leviathan's rule asks,
and a tree of per-depth top-k children is a deterministic function of the context (the one-hot
rule), as for every other drafter (docs/ARCHITECTURE.md).

Training (`forward`) runs depth 0 over every anchor row and depth s over a subset of the anchors of
depth s - 1 (conditional drop-token, COD: about n * max(r^s, r_min) anchors), all in one forward:
depth-s row i attends the depth-0 rows 0..i and its own rows of depths 1..s, exactly what serving
sees in its KV cache (tests/test_peagle.py checks the two against each other).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..models.prepack import prepack_head
from ..sequence import Sequence
from . import expand
from .base import Draft, register
from .eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model, _check_ints
from .head import CheckpointError


@dataclass
class PEagleConfig(Eagle3Config):
    MODEL_TYPE = "peagle"

    mask_token_id: int = 0  # a token of the target vocabulary; its (frozen) embedding marks depths >= 2
    cod_ratio: float = 0.7  # COD: depth s keeps ~ n * max(cod_ratio^s, cod_ratio_min) anchors in training
    cod_ratio_min: float = 0.2

    def to_speculators(self, dtype: str = "bfloat16") -> dict:
        d = super().to_speculators(dtype)
        d["architectures"] = ["PEagleSpeculator"]
        d.update({
            "mask_token_id": self.mask_token_id,
            "ptd_token_id": self.mask_token_id,  # the name vLLM's parallel-drafting proposer reads
            "para_depths": self.speculative_tokens,
            "down_sample_ratio": self.cod_ratio,
            "down_sample_ratio_min": self.cod_ratio_min,
        })
        return d

    @staticmethod
    def _extra_from_speculators(d: dict, where: str) -> dict:
        tok = d.get("mask_token_id", d.get("ptd_token_id", d.get("pard_token")))
        if tok is None:
            raise CheckpointError(f"{where}: a P-EAGLE config needs mask_token_id (or ptd_token_id)")
        _check_ints({"mask_token_id": tok}, where, "", "mask_token_id")
        return {"mask_token_id": tok, "cod_ratio": float(d.get("down_sample_ratio", 0.7)),
                "cod_ratio_min": float(d.get("down_sample_ratio_min", 0.2))}


def cod_rows(n: int, depths: int, ratio: float, ratio_min: float, generator=None) -> list[torch.Tensor]:
    """COD sampling of anchor rows: depth 0 keeps all n rows, depth s a random subset of about
    n * max(ratio^s, ratio_min) rows of those kept at depth s - 1 (sorted)."""
    rows = [torch.arange(n)]
    for s in range(1, depths):
        prev = rows[-1]
        keep = min(len(prev), max(1, round(n * max(ratio**s, ratio_min))))
        pick = torch.randperm(len(prev), generator=generator)[:keep]
        rows.append(prev[pick.sort().values])
    return rows


class PEagleModel(Eagle3Model):
    CONFIG = PEagleConfig

    def __init__(self, c: PEagleConfig, embed_weight: torch.Tensor | None = None):
        super().__init__(c, embed_weight)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(c.aux_layers) * c.hidden_size))

    @classmethod
    def check_target(cls, c: PEagleConfig, target, where: str) -> None:
        super().check_target(c, target, where)
        if not 0 <= c.mask_token_id < target.config.vocab_size:
            raise CheckpointError(f"{where}: mask_token_id {c.mask_token_id} is outside the target's vocabulary "
                                  f"(0..{target.config.vocab_size - 1})")

    def mask_state(self) -> torch.Tensor:
        """[H] the fused hidden input of every row of depth >= 2."""
        return self.fuse(self.mask_hidden)[0, 0]

    def forward(self, aux: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, steps: int = 3,
                rows: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """All depths in one forward (training).

        aux [B, T, n*H], ids [B, T], valid [B, T] as for EAGLE-3 (head.py `DraftHead.forward`);
        rows[s]: the anchor rows run at depth s (default: all T - 1 at every depth; `cod_rows`).
        Returns per depth s the logits [B, len(rows[s]), Vd]: row j is anchor rows[s][j]'s
        distribution for token x_{rows[s][j] + 2 + s}."""
        B, T = ids.shape
        n = T - 1
        dev = ids.device
        rows = [r.to(dev) for r in rows] if rows is not None else [torch.arange(n, device=dev)] * steps
        hidden = self.fuse(aux[:, :n])  # [B, n, H]
        H = hidden.shape[-1]
        x0 = torch.cat([self.embed(ids[:, 1:]).to(hidden.dtype), hidden], -1)  # [B, n, 2H] depth 0
        mask_x = torch.cat([self.embed(torch.tensor([self.config.mask_token_id], device=dev))[0].to(hidden.dtype),
                            self.mask_state().to(hidden.dtype)])  # [2H]
        R = sum(len(r) for r in rows[1:])
        x = torch.cat([x0, mask_x.expand(B, R, 2 * H)], 1)  # [B, n + R, 2H]
        anchor = torch.cat(rows)  # [N] the anchor row of each query
        depth = torch.cat([torch.full((len(r),), s, device=dev) for s, r in enumerate(rows)])
        positions = (anchor + 1 + depth)[None].expand(B, -1)
        kvalid = valid[:, 1:][:, anchor]  # [B, N] row i reads x_{i+1}
        aq, ak, dq, dk = anchor[:, None], anchor[None, :], depth[:, None], depth[None, :]
        context = (dk == 0) & (ak <= aq) & kvalid[:, None, :]  # [B, N, N] the depth-0 rows up to the anchor
        own = (ak == aq) & (dk <= dq)  # the anchor's own chain (itself included)
        mask = (context | own)[:, None]  # [B, 1, N, N]

        def kv(k, v):
            return k, v, mask

        y = self.run_layers(x, positions, [kv] * len(self.layers), hidden.dtype)
        logits = self.head_logits(self.norm(y))  # [B, N, Vd]
        return list(logits.split([len(r) for r in rows], 1))


def load_peagle(path: str | Path, target=None, dtype: torch.dtype = torch.float32) -> PEagleModel:
    return PEagleModel.load(path, target, dtype)


class PEagleDrafter(Eagle3Drafter):
    """Chains or trees from one forward: the catch-up rows, then k - 1 mask rows per sequence."""

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        idx = self._ready(seqs, ks)
        if not idx:
            return drafts
        run = [seqs[i] for i in idx]
        budgets = [ks[i] for i in idx]
        mask_in = (self.model.config.mask_token_id, self.model.mask_state().to(self.dtype))
        _, out, feeds = self._catch_up(run, [k - 1 for k in budgets], mask_in)
        # sequence b's distributions of draft depths 1..k, over the draft vocabulary [k, Vd]
        rows = torch.cat([out[b, e - a - 1 : e - a - 1 + k] for b, ((a, e), k) in enumerate(zip(feeds, budgets))])
        depth_logits = list(self.model.head_logits(rows).split(budgets))
        out = expand.draft_parallel(run, budgets, depth_logits, self.columns)
        for b, i in enumerate(idx):
            drafts[i] = out[b]
        return drafts


def is_peagle_dir(path: str) -> bool:
    return PEagleModel.is_checkpoint(path)


def make_peagle_drafter(path: str, target, max_batch: int, max_len: int, dtype, device) -> PEagleDrafter:
    model = load_peagle(path, target, dtype=target.dtype).to(device)
    prepack_head(model)  # bf16 on a CPU with bf16 arithmetic: oneDNN's blocked layout
    model.set_embedding(target.model.embed_tokens.weight)
    return PEagleDrafter(model, target, max_batch, max_len, name=f"peagle:{path}")


@register("peagle", "peagle:DIR (or a bare DIR)", "a P-EAGLE head (all K drafts in one forward), speculators format",
          detect=lambda p: is_peagle_dir(p))
def _make(arg: str, ctx) -> PEagleDrafter:
    try:
        return make_peagle_drafter(arg, ctx.target, ctx.max_batch, ctx.max_len, ctx.dtype, ctx.device)
    except CheckpointError as e:
        raise ValueError(str(e)) from e


__all__ = ["PEagleConfig", "PEagleModel", "PEagleDrafter", "cod_rows", "load_peagle", "make_peagle_drafter",
           "is_peagle_dir"]
