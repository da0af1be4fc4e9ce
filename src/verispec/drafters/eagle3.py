"""EAGLE-3 drafter: one module for training (training-time test unrolling) and serving (chain drafting).

Architecture (EAGLE-3, arXiv 2503.01840; weight names exactly as speculators / vLLM `eagle3`):

    g = fc(concat(N_a(h_a), N_b(h_b), N_c(h_c)))       3 target layer outputs -> H  (N_*: `fc_norm`, EAGLE 3.1)
    x = concat(embed(token), g)                       the target's (frozen, unscaled) embedding, 2H
    layer 0: residual = g; a = attn(concat(input_layernorm(e), hidden_norm(g)))   q/k/v read 2H
             y = g + o_proj(a); y = y + mlp(post_attention_layernorm(y))           a Llama block
    logits = lm_head(norm(y))                          over the reduced draft vocabulary (d2t / t2d)

Alignment (as speculators `shift_batch`): draft row i reads the target state g_i of token x_i and the
embedding of x_{i+1}, sits at RoPE position i + 1 and predicts x_{i+2}. At step s of the recurrence
the hidden input is the draft's own output state y of step s - 1 (post-norm with `norm_output`,
EAGLE 3.1) and the token is the one drafted (serving) or the ground truth shifted by s (training).

The layers are models.layers' Llama layers; everything but the input part (`fc`, the 2H first layer)
and the speculators config.json is shared with MTP in head.py (`DraftHead`): the vocabulary mapping,
RoPE, the training-time-test unroll (`forward`; tests/test_eagle3.py checks it against the serving
path) and the checked checkpoint load.

Draft vocabulary: `d2t[i]` is an offset, target id = i + d2t[i]; `t2d` is a bool mask over the target
vocabulary. Both are built from token-frequency counts (`build_vocab_mapping`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ..models.layers import DecoderLayer, RMSNorm, linear
from ..models.prepack import prepack_head
from ..sequence import Sequence
from .base import Draft, DrafterBase, register
from . import expand
from .head import CheckpointError, DraftHead, layer_config, speculators_block, speculators_layers

TREE_SCRATCH = 128  # KV rows past a sequence's end for the nodes a dynamic tree runs (width x depth)

ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


# --------------------------------------------------------------------------------------------
# configuration


@dataclass
class Eagle3Config:
    MODEL_TYPE: ClassVar[str] = "eagle3"  # speculators_model_type (P-EAGLE: "peagle")

    hidden_size: int  # = the target's hidden size
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layers: list[int]  # target layers whose outputs are fused
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    fc_norm: bool = False  # EAGLE 3.1: a norm on each target state before fusion
    norm_output: bool = False  # EAGLE 3.1: feed the post-norm state to the next step
    norm_before_fc: bool = False  # one norm over the concatenation (gpt-oss style)
    norm_before_residual: bool = False
    speculative_tokens: int = 3
    verifier: str | None = None  # name or path of the target
    verifier_architectures: list[str] = field(default_factory=list)
    target_num_layers: int | None = None

    @classmethod
    def for_target(cls, target, draft_vocab_size: int | None = None, aux_layers=None, **kw) -> "Eagle3Config":
        """Defaults from a target `CausalLM` (its hidden size, heads, vocabulary)."""
        c = target.config
        L = c.num_layers
        aux = list(aux_layers) if aux_layers is not None else default_aux_layers(L)
        kw.setdefault("num_heads", c.num_heads)
        kw.setdefault("num_kv_heads", c.num_kv_heads)
        kw.setdefault("head_dim", c.head_dim)
        kw.setdefault("intermediate_size", c.intermediate_size)
        kw.setdefault("rms_norm_eps", c.rms_norm_eps)
        kw.setdefault("max_position_embeddings", c.max_position_embeddings)
        kw.setdefault("verifier_architectures", [ARCHITECTURES.get(c.model_type, c.model_type)])
        return cls(hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                   draft_vocab_size=draft_vocab_size or c.vocab_size, aux_layers=aux, target_num_layers=L, **kw)

    # ---- the speculators config.json ----------------------------------------------------------
    def to_speculators(self, dtype: str = "bfloat16") -> dict:
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": self.MODEL_TYPE,
            "speculators_version": "0.9.0",
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": to_speculators_layers(self.aux_layers),
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "embed_requires_grad": False,
            "dtype": dtype,
            "transformer_layer_config": speculators_layers(self, "llama"),
            "speculators_config": speculators_block(self, self.MODEL_TYPE),
        }

    @staticmethod
    def _extra_from_speculators(d: dict, where: str) -> dict:
        """The fields a subclass's config.json adds (P-EAGLE: the mask token)."""
        return {}

    @classmethod
    def from_speculators(cls, d: dict, where: str = "config.json") -> "Eagle3Config":
        if d.get("speculators_model_type") != cls.MODEL_TYPE:
            raise CheckpointError(f"{where}: speculators_model_type is {d.get('speculators_model_type')!r}, "
                                  f"not {cls.MODEL_TYPE!r}")
        try:
            tl = d["transformer_layer_config"]
            sc = d.get("speculators_config") or {}
            ver = sc.get("verifier") or {}
            props = sc.get("proposal_methods") or [{}]
            if tl.get("model_type", "llama") != "llama":  # speculators also writes qwen3 layers (q/k norms)
                raise CheckpointError(f"{where}: draft layer type {tl.get('model_type')!r} is not supported yet "
                                      "(llama only)")
            H = tl["hidden_size"]
            nh = tl.get("num_attention_heads", 32)
            rp = tl.get("rope_parameters") or {}
            theta = rp.get("rope_theta", tl.get("rope_theta", 10000.0))
            if rp.get("rope_type", "default") != "default":
                raise CheckpointError(f"{where}: rope_type {rp.get('rope_type')!r} is not supported (default only)")
            aux = d.get("eagle_aux_hidden_state_layer_ids")
            if aux is None:
                raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids is missing")
            _check_ints(tl, where, "transformer_layer_config.", "hidden_size", "vocab_size", "intermediate_size",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
                        "max_position_embeddings")
            _check_ints(d, where, "", "draft_vocab_size")
            if not isinstance(aux, list) or not all(_is_int(i) for i in aux):
                raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of integers, got {aux!r}")
            if any(i < 1 for i in aux):
                raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids {aux} name the embeddings (id 0) or a "
                                      f"negative id; verispec taps layer outputs only (ids 1 and up)")
            ths = d.get("target_hidden_size")
            if ths is not None and ths != H:
                raise CheckpointError(f"{where}: target_hidden_size {ths} != draft hidden size {H} (not supported)")
            return cls(
                hidden_size=H, vocab_size=tl["vocab_size"], draft_vocab_size=d.get("draft_vocab_size", tl["vocab_size"]),
                aux_layers=from_speculators_layers(aux), num_heads=nh, num_kv_heads=tl.get("num_key_value_heads", nh),
                head_dim=tl.get("head_dim") or H // nh, intermediate_size=tl["intermediate_size"],
                num_layers=tl.get("num_hidden_layers", 1), rms_norm_eps=tl.get("rms_norm_eps", 1e-6), rope_theta=theta,
                max_position_embeddings=tl.get("max_position_embeddings", 4096), fc_norm=bool(d.get("fc_norm", False)),
                norm_output=bool(d.get("norm_output", False)), norm_before_fc=bool(d.get("norm_before_fc", False)),
                norm_before_residual=bool(d.get("norm_before_residual", False)),
                speculative_tokens=props[0].get("speculative_tokens", 3), verifier=ver.get("name_or_path"),
                verifier_architectures=list(ver.get("architectures") or []), **cls._extra_from_speculators(d, where),
            )
        except CheckpointError:
            raise
        except KeyError as e:
            raise CheckpointError(f"{where}: required field {e} is missing") from e
        except (TypeError, ValueError, AttributeError) as e:  # e.g. head_dim derived from a hidden size that is a string
            raise CheckpointError(f"{where}: {e}") from e


def to_speculators_layers(aux_layers: list[int]) -> list[int]:
    """verispec's aux layer i is the output of target layer i; the speculators format (and vLLM,
    which reads it) counts hidden states as transformers' `hidden_states` does: id 0 the embeddings,
    id i the state entering layer i, so the output of layer i is id i + 1."""
    return [i + 1 for i in aux_layers]


def from_speculators_layers(ids: list[int]) -> list[int]:
    return [i - 1 for i in ids]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_ints(d: dict, where: str, prefix: str, *keys: str) -> None:
    """Integer fields must be JSON integers: a hidden size of "640" would otherwise end in
    messages like "640 != 640" or a shape error deep in the model."""
    for k in keys:
        v = d.get(k)
        if v is not None and (not _is_int(v) or v < 0):
            raise CheckpointError(f"{where}: {prefix}{k} must be a non-negative integer, got {v!r}")


INT_FIELDS = ("hidden_size", "vocab_size", "draft_vocab_size", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "num_layers", "max_position_embeddings", "speculative_tokens")


def check_config_types(c: "Eagle3Config", where: str) -> None:
    """The types of a config built from a verispec (MTP) config.json, checked the same way."""
    _check_ints(vars(c), where, "", *INT_FIELDS)
    if not isinstance(c.aux_layers, list) or not all(_is_int(i) for i in c.aux_layers):
        raise CheckpointError(f"{where}: aux_layers must be a list of integers, got {c.aux_layers!r}")


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high target layers: [2, L // 2, L - 3]; for small targets where those
    collide, three (or fewer) distinct layers spread evenly (speculators refuses duplicates)."""
    L = num_layers
    ids = [2, L // 2, L - 3]
    if len(set(ids)) == 3 and min(ids) >= 0 and ids == sorted(ids):
        return ids
    return sorted({round(i * (L - 1) / 2) for i in range(3)})


# --------------------------------------------------------------------------------------------
# vocabulary mapping


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [V] token frequencies -> (d2t [Vd] int64 offsets, t2d [V] bool).

    The `draft_vocab_size` most frequent ids are kept (ties and unseen ids: lowest id first), sorted
    by id, so target id = i + d2t[i] is increasing.
    """
    V = counts.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V}, got {draft_vocab_size}")
    # stable sort by count descending: equal counts keep the lower id first
    order = torch.sort(-counts.double(), stable=True).indices[:draft_vocab_size]
    keep = order.sort().values
    d2t = keep - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    return d2t.long(), t2d


# --------------------------------------------------------------------------------------------
# the module


class Eagle3FirstLayer(DecoderLayer):
    """EAGLE-3's first layer: attention reads concat(input_layernorm(embedding), hidden_norm(g)) (2H), and
    the residual is g (hidden_norm(g) with `norm_before_residual`). Later layers are plain Llama layers."""

    def __init__(self, c: Eagle3Config):
        super().__init__(layer_config(c), attn_in=2 * c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm_before_residual = c.norm_before_residual

    def forward(self, x, cos, sin, kv):
        e, h = x.chunk(2, dim=-1)
        hn = self.hidden_norm(h)
        a = self.self_attn(torch.cat([self.input_layernorm(e), hn], dim=-1), cos, sin, kv)
        return self.residual_mlp((hn if self.norm_before_residual else h) + a)


class Eagle3Model(DraftHead):
    """The drafter's weights (names as speculators writes them) plus a frozen reference to the target's
    embedding table (not a parameter, not saved: vLLM and speculators take it from the verifier)."""

    FORMAT = "speculators"
    CONFIG = Eagle3Config
    # speculators may save the verifier's embedding / head / norm; we use the target's
    IGNORED_TENSORS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")

    def __init__(self, c: Eagle3Config, embed_weight: torch.Tensor | None = None):
        H, n = c.hidden_size, len(c.aux_layers)
        if c.fc_norm and c.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are mutually exclusive")
        inputs = {}
        if c.fc_norm:
            inputs["fc_norm"] = nn.ModuleList(RMSNorm(H, c.rms_norm_eps) for _ in range(n))
        if c.norm_before_fc:
            inputs["input_norm"] = RMSNorm(n * H, c.rms_norm_eps)
        inputs["fc"] = nn.Linear(n * H, H, bias=False)
        super().__init__(c, embed_weight, inputs, first_layer=Eagle3FirstLayer(c))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n*H] (target layer outputs, concatenated in aux_layers order) -> [..., H]."""
        aux = aux.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat([nrm(a) for nrm, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return linear(aux, self.fc.weight)

    def step_states(self, ids, hidden, positions, kvs):
        """One draft step without the LM head: ids [B, T] tokens, hidden [B, T, H] (fused target
        state, or the previous step's output), positions [B, T]; kvs[l](k, v) -> (K, V, mask) per
        layer (models.layers). Returns (next hidden [B, T, H], post-norm state [B, T, H] for the head)."""
        x = torch.cat([self.embed(ids).to(hidden.dtype), hidden], -1)
        y = self.run_layers(x, positions, kvs, hidden.dtype)
        if self.config.norm_output:  # EAGLE 3.1: the next step reads the post-norm state
            y = self.norm(y)
            return y, y
        return y, self.norm(y)

    # ---- checkpoint (speculators format) ----------------------------------------------------------
    def config_json(self, dtype_name: str) -> dict:
        return self.config.to_speculators(dtype_name)

    @classmethod
    def claims(cls, d: dict) -> bool:
        return d.get("speculators_model_type") == cls.CONFIG.MODEL_TYPE

    @classmethod
    def config_from_json(cls, d: dict, where: str) -> Eagle3Config:
        return cls.CONFIG.from_speculators(d, where)

    @classmethod
    def check_target(cls, c: Eagle3Config, target, where: str) -> None:
        super().check_target(c, target, where)
        t = target.config
        bad = [i for i in c.aux_layers if not 0 <= i < t.num_layers]
        if bad:
            raise CheckpointError(f"{where}: target layer ids {bad} out of range for a {t.num_layers}-layer target")
        arch = ARCHITECTURES.get(t.model_type)
        if c.verifier_architectures and arch and arch not in c.verifier_architectures:
            raise CheckpointError(f"{where}: made for verifier {c.verifier_architectures} ({c.verifier}), "
                                  f"but the target is {arch}")


def load_eagle3(path: str | Path, target=None, dtype: torch.dtype = torch.float32) -> Eagle3Model:
    """Load a speculators-format EAGLE-3 checkpoint folder; with `target`, check it was made for it
    and attach the target's embedding. Refuses bad checkpoints with a message naming the problem."""
    return Eagle3Model.load(path, target, dtype)


# --------------------------------------------------------------------------------------------
# serving


@dataclass
class _State:
    slot: int
    fused: torch.Tensor  # [max_rows, H] fc(target states) of the committed tokens, row i = token i
    n_obs: int = 0  # target states received (tokens 0 .. n_obs-1)
    n_real: int = 0  # draft KV rows built from target states (row i: g_i + x_{i+1})


class Eagle3Drafter(DrafterBase):
    """Chain or tree drafting (drafters/expand.py) with an EAGLE-3 (or MTP) head and its own small
    KV cache (one slot per sequence; draft nodes run in scratch rows past the committed ones)."""

    def __init__(self, model: Eagle3Model, target, max_batch: int, max_len: int, name: str = "eagle3"):
        from ..kv import KVCache

        self.model, self.name = model, name
        c = model.config
        self.target_taps = tuple(c.aux_layers)
        self.dtype = model.fc.weight.dtype
        self.device = model.fc.weight.device
        self.cache = KVCache(c.num_layers, max_batch, max_len + TREE_SCRATCH, c.num_kv_heads, c.head_dim, self.dtype,
                             self.device)
        self.max_len = max_len + TREE_SCRATCH
        self.columns = model.columns()

    def _state(self, seq: Sequence) -> _State:
        if seq.drafter_state is None:
            n = len(seq.prompt_ids) + seq.params.max_tokens + 1
            slot = self.cache.allocate(min(n, self.max_len))
            seq.drafter_state = _State(slot, torch.zeros(n, self.model.config.hidden_size, dtype=self.dtype, device=self.device))
        return seq.drafter_state

    @torch.inference_mode()
    def on_commit(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        st = self._state(seq)
        aux = torch.cat([hidden[i] for i in self.target_taps], -1)  # [n, 3H]
        n = aux.shape[0]
        if start > st.n_obs:  # a gap: the drafter missed states; start over from what it has
            return
        st.fused[start : start + n] = self.model.fuse(aux).to(self.dtype)
        st.n_obs = start + n
        st.n_real = min(st.n_real, start)

    def _kv(self, l, slots, starts, T, mask=None):
        cache = self.cache
        dev = self.device
        # padding rows of a catch-up batch may run past the slot: clamp them onto the last row, which
        # holds no committed row of this sequence and is rewritten before any query can see it
        rows = (starts[:, None] + torch.arange(T, device=dev)).clamp(max=self.max_len - 1)  # [B, T]
        Lk = int(rows.max()) + 1
        sl = torch.tensor(slots, device=dev)
        j = torch.arange(Lk, device=dev)
        if mask is None:  # causal over this sequence's rows
            mask = (j[None, None, :] <= rows[:, :, None])[:, None]  # [B, 1, T, Lk]
        else:  # a tree: each query's visible rows, given
            mask = torch.nn.functional.pad(mask, (0, max(0, Lk - mask.shape[-1])))[..., :Lk]

        def kv(k, v):  # k, v [B, kvh, T, hd]
            cache.k[l][sl[:, None], :, rows] = k.transpose(1, 2).to(self.dtype)
            cache.v[l][sl[:, None], :, rows] = v.transpose(1, 2).to(self.dtype)
            K = cache.k[l][sl[:, None], :, j[None, :]].permute(0, 2, 1, 3)
            V = cache.v[l][sl[:, None], :, j[None, :]].permute(0, 2, 1, 3)
            return K, V, mask
        return kv

    def _run(self, ids, hidden, starts, slots):
        T = ids.shape[1]
        positions = starts[:, None] + torch.arange(T, device=self.device) + 1  # row i sits at position i + 1
        kvs = [self._kv(l, slots, starts, T) for l in range(len(self.model.layers))]
        return self.model.step_states(ids, hidden, positions, kvs)

    def _ready(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        """Indices of the sequences that can draft now: a budget, and the target state of every
        committed token but the last (which the next verify computes)."""
        idx = []
        for i, (s, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            st = self._state(s)
            n = len(s.tokens) - 1
            if st.n_obs < n or n < 1 or n + k > self.max_len:
                continue
            idx.append(i)
        return idx

    def _catch_up(self, run: list[Sequence], extra: list[int] | None = None, extra_input=None):
        """One forward over each sequence's rows n_real .. n-1 from the target states (row n-1 is
        always re-run for its output), followed by `extra[b]` rows of `extra_input` = (token id,
        hidden [H]) (P-EAGLE's mask rows). Returns (h [B, T, H], post-norm states [B, T, H], feeds),
        where feeds[b] = (a, e): sequence b's real rows a .. e-1 sit at [b, 0 : e - a]. The caller
        runs the LM head on the rows it drafts from (the largest matmul: not on every row)."""
        states = [s.drafter_state for s in run]
        extra = extra or [0] * len(run)
        feeds = []
        for s, st in zip(run, states):
            n = len(s.tokens) - 1
            st.n_real = min(st.n_real, n - 1)
            feeds.append((st.n_real, n))
        T = max(e - a + x for (a, e), x in zip(feeds, extra))
        H = self.model.config.hidden_size
        ids = torch.zeros(len(run), T, dtype=torch.long, device=self.device)
        hid = torch.zeros(len(run), T, H, dtype=self.dtype, device=self.device)
        for b, ((a, e), s, st) in enumerate(zip(feeds, run, states)):
            ids[b, : e - a] = torch.tensor(s.tokens[a + 1 : e + 1], device=self.device)
            hid[b, : e - a] = st.fused[a:e]
            if extra[b]:
                ids[b, e - a : e - a + extra[b]] = extra_input[0]
                hid[b, e - a : e - a + extra[b]] = extra_input[1]
        starts = torch.tensor([a for a, _ in feeds], device=self.device)
        h, out = self._run(ids, hid, starts, [st.slot for st in states])
        for (a, e), st in zip(feeds, states):
            st.n_real = e
        return h, out, feeds

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        idx = self._ready(seqs, ks)
        if not idx:
            return drafts
        run = [seqs[i] for i in idx]
        states = [s.drafter_state for s in run]
        slots = [st.slot for st in states]
        # 1. catch up: rows n_real .. n-1 from the target states
        h, out, feeds = self._catch_up(run)
        last = torch.tensor([e - a - 1 for a, e in feeds], device=self.device)
        ar = torch.arange(len(run), device=self.device)
        h, logits = h[ar, last], self.model.head_logits(out[ar, last])  # [B, H], [B, Vd]
        # 2. chains or trees (expand.py decides which nodes run); node i of sequence b runs in
        # scratch row e_b + (its run index), at position e_b + depth, reading its parent's state
        ends = [e for _, e in feeds]
        hid = {(b, -1): h[b] for b in range(len(run))}
        row_of: dict[tuple[int, int], int] = {}
        used = [0] * len(run)

        def step(run_nodes, nodes):
            live = [b for b, r in enumerate(run_nodes) if r]
            T = max(len(run_nodes[b]) for b in live)
            ids = torch.zeros(len(live), T, dtype=torch.long, device=self.device)
            hs = torch.zeros(len(live), T, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
            pos = torch.zeros(len(live), T, dtype=torch.long, device=self.device)
            vis = []
            for j, b in enumerate(live):
                for t, i in enumerate(run_nodes[b]):
                    node = nodes[b][i]
                    row_of[(b, i)] = ends[b] + used[b] + t
                    if row_of[(b, i)] >= self.max_len:
                        raise RuntimeError(f"draft tree needs more than the {self.max_len} KV rows of the drafter")
                    ids[j, t], hs[j, t], pos[j, t] = node.token, hid[(b, node.parent)], ends[b] + node.depth
                    path, a = [], i
                    while a >= 0:
                        path.append(row_of[(b, a)])
                        a = nodes[b][a].parent
                    vis.append((j, t, ends[b], path))  # it sees the committed rows and its path
                used[b] += len(run_nodes[b])
            starts = torch.tensor([ends[b] + used[b] - len(run_nodes[b]) for b in live], device=self.device)
            Lk = max(max(path) for *_, path in vis) + 1
            mask = torch.zeros(len(live), 1, T, Lk, dtype=torch.bool, device=self.device)
            for j, t, end, path in vis:
                mask[j, 0, t, :end] = True
                mask[j, 0, t, path] = True
            for j in range(len(live)):  # padding queries see their own row only (outputs dropped)
                for t in range(len(run_nodes[live[j]]), T):
                    mask[j, 0, t, 0] = True
            kvs = [self._kv(l, [slots[b] for b in live], starts, T, mask) for l in range(len(self.model.layers))]
            hn, lg = self.model.step(ids, hs, pos, kvs)
            out = [None] * len(run_nodes)
            for j, b in enumerate(live):
                for t, i in enumerate(run_nodes[b]):
                    hid[(b, i)] = hn[j, t]
                out[b] = lg[j, : len(run_nodes[b])]
            return out

        out = expand.draft(run, [ks[i] for i in idx], logits, step, self.columns)
        for b, i in enumerate(idx):
            drafts[i] = out[b]
        return drafts

    def release(self, seq: Sequence) -> None:
        if seq.drafter_state is not None:
            self.cache.free(seq.drafter_state.slot)
            seq.drafter_state = None


def is_eagle3_dir(path: str) -> bool:
    return Eagle3Model.is_checkpoint(path)


@register("eagle3", "eagle3:DIR (or a bare DIR)", "an EAGLE-3 head in the speculators format", detect=lambda p: is_eagle3_dir(p))
def _make(arg: str, ctx) -> "Eagle3Drafter":
    try:
        return make_eagle3_drafter(arg, ctx.target, ctx.max_batch, ctx.max_len, ctx.dtype, ctx.device)
    except CheckpointError as e:
        raise ValueError(str(e)) from e


def make_eagle3_drafter(path: str, target, max_batch: int, max_len: int, dtype: torch.dtype, device) -> Eagle3Drafter:
    model = load_eagle3(path, target, dtype=target.dtype).to(device)
    prepack_head(model)  # bf16 on a CPU with bf16 arithmetic: oneDNN's blocked layout
    model.set_embedding(target.model.embed_tokens.weight)
    return Eagle3Drafter(model, target, max_batch, max_len, name=f"eagle3:{path}")


def vllm_command(path: str, num_tokens: int | None = None, parallel: bool = False) -> str:
    """The `vllm serve` line for an EAGLE-3 (or, with `parallel`, a P-EAGLE) checkpoint folder."""
    d = json.loads((Path(path) / "config.json").read_text())
    c = (Eagle3Config if not parallel else _peagle_config()).from_speculators(d)
    spec = {"method": "eagle3", "model": str(Path(path).resolve()), "num_speculative_tokens": num_tokens or c.speculative_tokens}
    if parallel:
        spec["parallel_drafting"] = True
    target = c.verifier or "<target model>"
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def _peagle_config():
    from .peagle import PEagleConfig

    return PEagleConfig


__all__ = ["Eagle3Config", "Eagle3Model", "Eagle3Drafter", "CheckpointError", "build_vocab_mapping", "load_eagle3",
           "default_aux_layers", "is_eagle3_dir", "make_eagle3_drafter", "vllm_command"]
