"""DFlash drafter (block diffusion, arXiv 2602.06036): a block of draft tokens from one forward, with
the target's features injected as keys and values.

    ctx_j    = hidden_norm(fc(concat(h_{l1}(x_j), .., h_{lm}(x_j))))      target layers, fused per token
    block    = [embed(x_p), embed(mask) x (S - 1)] at positions p .. p+S-1  x_p: the last committed token
    layer l  : queries from the block; keys/values = [k/v_proj(ctx_0..ctx_{p-1}) ; k/v_proj(block)]
               (Qwen3 layers: q/k norms, RoPE at each row's position); the block attends to all of
               itself (bidirectional) and to the context before the anchor
    logits   = lm_head(norm(y)); slot k (1..S-1) drafts x_{p+k}

The target's embedding is shared and frozen (attached by reference, never saved); the LM head is the
target's rows of the draft vocabulary (trained or frozen). Weight names and config.json follow
speculators' `dflash` format (`DFlashSpeculatorConfig`), which vLLM serves with `"method": "dflash"`.

Serving keeps, per sequence and layer, the context keys and values in the drafter's KV cache: they
depend on the target's states only, so each committed token's rows are computed once, when its
states arrive (`on_commit`); a round runs just the S block rows against them.

Why it stays lossless: the S - 1 distributions depend on the committed context only, so chains drawn
from them (q_k does not depend on the tokens drafted before k) and trees of per-slot top-k children
verify exactly as for every other drafter (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..models.layers import RMSNorm, linear, rotate
from ..models.prepack import prepack_head
from ..sequence import Sequence
from . import expand
from .base import Draft, DrafterBase, register
from .eagle3 import (ARCHITECTURES, _check_ints, _is_int, from_speculators_layers, to_speculators_layers)
from .head import CheckpointError, DraftHead, layer_config, speculators_block, speculators_layers


def default_dflash_layers(num_layers: int, count: int) -> list[int]:
    """`count` target layers spread evenly from layer 1 to L - 3 (DFlash's choice; one layer: L // 2)."""
    if count == 1:
        return [num_layers // 2]
    lo, hi = 1, max(1, num_layers - 3)
    return sorted({int(round(lo + i * (hi - lo) / (count - 1))) for i in range(count)})


@dataclass
class DFlashConfig:
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layers: list[int]  # target layers whose outputs are fused into the context
    block_size: int = 8  # S: the anchor + S - 1 mask slots
    mask_token_id: int = 0
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    num_layers: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    verifier: str | None = None
    verifier_architectures: list[str] = field(default_factory=list)
    # a norm on each target layer's state before `fc` (as EAGLE 3.1's fc_norm): Gemma 3's layer outputs
    # differ in scale by orders of magnitude, and the fused context trained without it does not learn
    # (position-1 acceptance 0.16 after 200 steps on Gemma 3 270M). Written to config.json only when
    # set; vLLM's DFlash does not know it, so `verispec export --vllm` refuses such a checkpoint.
    fc_norm: bool = False

    @property
    def speculative_tokens(self) -> int:
        return self.block_size - 1

    @classmethod
    def for_target(cls, target, draft_vocab_size: int | None = None, aux_layers=None, **kw) -> "DFlashConfig":
        c = target.config
        kw.setdefault("num_heads", c.num_heads)
        kw.setdefault("num_kv_heads", c.num_kv_heads)
        kw.setdefault("head_dim", c.head_dim)
        kw.setdefault("intermediate_size", c.intermediate_size)
        kw.setdefault("rms_norm_eps", c.rms_norm_eps)
        kw.setdefault("max_position_embeddings", c.max_position_embeddings)
        kw.setdefault("verifier_architectures", [ARCHITECTURES.get(c.model_type, c.model_type)])
        n = kw.get("num_layers", 2)
        aux = list(aux_layers) if aux_layers is not None else default_dflash_layers(c.num_layers, max(n, 1))
        return cls(hidden_size=c.hidden_size, vocab_size=c.vocab_size, draft_vocab_size=draft_vocab_size or c.vocab_size,
                   aux_layers=aux, **kw)

    def to_speculators(self, dtype: str = "bfloat16") -> dict:
        d = {
            "architectures": ["DFlashSpeculator"],
            "speculators_model_type": "dflash",
            "speculators_version": "0.9.0",
            "draft_vocab_size": self.draft_vocab_size,
            "block_size": self.block_size,
            "target_hidden_size": None,
            "aux_hidden_state_layer_ids": to_speculators_layers(self.aux_layers),
            "mask_token_id": self.mask_token_id,
            "sliding_window_non_causal": False,
            "sample_from_anchor": False,
            "dtype": dtype,
            "transformer_layer_config": speculators_layers(self, "qwen3"),
            "speculators_config": speculators_block(self, "dflash"),
        }
        if self.fc_norm:  # only when set: the default is speculators' own format
            d["fc_norm"] = True
        return d

    @classmethod
    def from_speculators(cls, d: dict, where: str = "config.json") -> "DFlashConfig":
        if d.get("speculators_model_type") != "dflash":
            raise CheckpointError(f"{where}: speculators_model_type is {d.get('speculators_model_type')!r}, not 'dflash'")
        try:
            tl = d["transformer_layer_config"]
            ver = (d.get("speculators_config") or {}).get("verifier") or {}
            if tl.get("model_type", "qwen3") != "qwen3":
                raise CheckpointError(f"{where}: draft layer type {tl.get('model_type')!r} is not supported (qwen3 only)")
            if d.get("sample_from_anchor"):
                raise CheckpointError(f"{where}: sample_from_anchor is set (a DSpark-style backbone); DFlash drafts "
                                      "from the mask slots only")
            if d.get("target_hidden_size") not in (None, tl.get("hidden_size")):
                raise CheckpointError(f"{where}: target_hidden_size {d['target_hidden_size']} differs from the draft's "
                                      f"hidden size {tl.get('hidden_size')} (not supported)")
            rp = tl.get("rope_parameters") or {}
            if rp.get("rope_type", "default") != "default":
                raise CheckpointError(f"{where}: rope_type {rp.get('rope_type')!r} is not supported (default only)")
            _check_ints(tl, where, "transformer_layer_config.", "hidden_size", "vocab_size", "intermediate_size",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
                        "max_position_embeddings")
            _check_ints(d, where, "", "draft_vocab_size", "block_size", "mask_token_id")
            aux = d.get("aux_hidden_state_layer_ids")
            if not isinstance(aux, list) or not aux or not all(_is_int(i) and i >= 1 for i in aux):
                raise CheckpointError(f"{where}: aux_hidden_state_layer_ids must be a list of layer ids >= 1, got {aux!r}")
            if d.get("mask_token_id") is None:
                raise CheckpointError(f"{where}: mask_token_id is missing")
            if d.get("block_size", 8) < 2:
                raise CheckpointError(f"{where}: block_size must be at least 2, got {d.get('block_size')}")
            H, nh = tl["hidden_size"], tl.get("num_attention_heads", 32)
            return cls(
                hidden_size=H, vocab_size=tl["vocab_size"], draft_vocab_size=d.get("draft_vocab_size", tl["vocab_size"]),
                aux_layers=from_speculators_layers(aux), block_size=d.get("block_size", 8), mask_token_id=d["mask_token_id"],
                num_heads=nh, num_kv_heads=tl.get("num_key_value_heads", nh), head_dim=tl.get("head_dim") or H // nh,
                intermediate_size=tl["intermediate_size"], num_layers=tl.get("num_hidden_layers", 1),
                rms_norm_eps=tl.get("rms_norm_eps", 1e-6), rope_theta=rp.get("rope_theta", tl.get("rope_theta", 10000.0)),
                max_position_embeddings=tl.get("max_position_embeddings", 4096), verifier=ver.get("name_or_path"),
                verifier_architectures=list(ver.get("architectures") or []), fc_norm=bool(d.get("fc_norm", False)),
            )
        except CheckpointError:
            raise
        except KeyError as e:
            raise CheckpointError(f"{where}: required field {e} is missing") from e
        except (TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{where}: {e}") from e


class DFlashModel(DraftHead):
    FORMAT = "speculators"
    IGNORED_TENSORS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
    # speculators leaves the LM head out of a full-vocabulary DFlash checkpoint: it is the target's
    FROM_TARGET = {"lm_head.weight": lambda m, t: t.head_weight()[m.draft_to_target().to(t.head_weight().device)]}

    def __init__(self, c: DFlashConfig, embed_weight: torch.Tensor | None = None):
        inputs = {}
        if c.fc_norm:
            inputs["fc_norm"] = nn.ModuleList(RMSNorm(c.hidden_size, c.rms_norm_eps) for _ in c.aux_layers)
        inputs["fc"] = nn.Linear(len(c.aux_layers) * c.hidden_size, c.hidden_size, bias=False)
        inputs["hidden_norm"] = RMSNorm(c.hidden_size, c.rms_norm_eps)
        super().__init__(c, embed_weight, inputs)

    @staticmethod
    def layer_config(c):
        return dataclasses.replace(layer_config(c), model_type="qwen3", qk_norm=True)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n*H] target layer outputs -> the fused context features [..., H]."""
        aux = aux.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            aux = torch.cat([nrm(a) for nrm, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return self.hidden_norm(linear(aux, self.fc.weight))

    def context_kv(self, l: int, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's keys and values of context features ctx [B, C, H] at `positions` [B, C]:
        ([B, kvh, C, hd] after its k norm and RoPE, [B, kvh, C, hd])."""
        a = self.layers[l].self_attn
        c = self.config
        B, C, _ = ctx.shape
        k = linear(ctx, a.k_proj.weight).reshape(B, C, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = linear(ctx, a.v_proj.weight).reshape(B, C, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions, k.dtype)
        return rotate(a.k_norm(k), cos, sin), v

    def block_input(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """anchor_ids [...] -> block token ids [..., S]: the anchor, then S - 1 mask tokens."""
        S = self.config.block_size
        ids = torch.full((*anchor_ids.shape, S), self.config.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        ids[..., 0] = anchor_ids
        return ids

    def run_block(self, block_ids: torch.Tensor, positions: torch.Tensor, kvs, dtype) -> torch.Tensor:
        """block_ids [B, Q], positions [B, Q]; kvs[l](k, v) -> (K, V, mask). Returns the post-norm
        states [B, Q, H] (logits: `head_logits`)."""
        x = self.embed(block_ids).to(dtype)
        return self.norm(self.run_layers(x, positions, kvs, dtype))

    # ---- training: random anchor blocks ---------------------------------------------------------------
    def forward(self, aux: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n*H] target states of tokens x_0..x_{T-1}, ids [B, T], valid [B, T] bool, anchors
        [B, A] anchor positions (each >= 1). Returns logits [B, A, S, Vd]: block slot k of anchor a
        drafts x_{a+k} (slot 0, the anchor itself, is not a prediction)."""
        return self.head_logits(self.block_states(aux, ids, valid, anchors))

    def block_states(self, aux, ids, valid, anchors) -> torch.Tensor:
        """`forward`'s blocks as post-norm states [B, A, S, H]. Block rows see the context features of
        x_0 .. x_{a-1} (valid ones) and their whole block: what serving computes."""
        B, T = ids.shape
        A, S = anchors.shape[1], self.config.block_size
        dev = ids.device
        ctx = self.context(aux)  # [B, T, H]
        dtype = ctx.dtype
        block = self.block_input(ids.gather(1, anchors))  # [B, A, S]
        pos = anchors[..., None] + torch.arange(S, device=dev)  # [B, A, S]
        ctx_pos = torch.arange(T, device=dev)[None].expand(B, T)
        see_ctx = (ctx_pos[:, None, :] < anchors[..., None]) & valid[:, None, :]  # [B, A, T]
        blk = torch.arange(A, device=dev)
        see_blk = blk[:, None] == blk[None, :]  # [A, A] own block only
        mask = torch.cat([see_ctx.repeat_interleave(S, 1),  # [B, A*S, T]
                          see_blk.repeat_interleave(S, 0).repeat_interleave(S, 1)[None].expand(B, -1, -1)], -1)[:, None]

        def make_kv(l):
            def kv(k, v):
                ck, cv = self.context_kv(l, ctx, ctx_pos)
                return torch.cat([ck.to(k.dtype), k], 2), torch.cat([cv.to(v.dtype), v], 2), mask
            return kv

        h = self.run_block(block.reshape(B, A * S), pos.reshape(B, A * S),
                           [make_kv(l) for l in range(len(self.layers))], dtype)
        return h.reshape(B, A, S, -1)

    # ---- checkpoint (speculators format) ----------------------------------------------------------
    def config_json(self, dtype_name: str) -> dict:
        return self.config.to_speculators(dtype_name)

    @classmethod
    def claims(cls, d: dict) -> bool:
        return d.get("speculators_model_type") == "dflash"

    @classmethod
    def config_from_json(cls, d: dict, where: str) -> DFlashConfig:
        return DFlashConfig.from_speculators(d, where)

    @classmethod
    def check_target(cls, c: DFlashConfig, target, where: str) -> None:
        super().check_target(c, target, where)
        t = target.config
        bad = [i for i in c.aux_layers if not 0 <= i < t.num_layers]
        if bad:
            raise CheckpointError(f"{where}: target layer ids {bad} out of range for a {t.num_layers}-layer target")
        if not 0 <= c.mask_token_id < t.vocab_size:
            raise CheckpointError(f"{where}: mask_token_id {c.mask_token_id} is outside the target's vocabulary "
                                  f"(0..{t.vocab_size - 1})")


def load_dflash(path: str | Path, target=None, dtype: torch.dtype = torch.float32) -> DFlashModel:
    return DFlashModel.load(path, target, dtype)


# --------------------------------------------------------------------------------------------
# serving


@dataclass
class _State:
    slot: int
    n_obs: int = 0  # context rows in the cache (tokens 0 .. n_obs-1)


class DFlashDrafter(DrafterBase):
    """One forward per step for the whole batch: each sequence's block against its cached context."""

    def __init__(self, model: DFlashModel, target, max_batch: int, max_len: int, name: str = "dflash"):
        from ..kv import KVCache

        self.model, self.name = model, name
        c = model.config
        self.target_taps = tuple(c.aux_layers)
        self.dtype = model.fc.weight.dtype
        self.device = model.fc.weight.device
        self.max_len = max_len
        self.cache = KVCache(c.num_layers, max_batch, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)
        self.columns = model.columns()

    def _state(self, seq: Sequence) -> _State:
        if seq.drafter_state is None:
            n = len(seq.prompt_ids) + seq.params.max_tokens + 1
            seq.drafter_state = _State(self.cache.allocate(min(n, self.max_len)))
        return seq.drafter_state

    @torch.inference_mode()
    def on_commit(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        st = self._state(seq)
        if start > st.n_obs:  # a gap: the drafter missed states; it stops drafting for this sequence
            return
        aux = torch.cat([hidden[i] for i in self.target_taps], -1)[None]  # [1, n, 3H]
        n = aux.shape[1]
        if start + n > self.max_len:  # rows past the cache: the sequence stops drafting there
            n = self.max_len - start
            if n <= 0:
                return
            aux = aux[:, :n]
        ctx = self.model.context(aux)
        pos = torch.arange(start, start + n, device=self.device)[None]
        for l in range(len(self.model.layers)):
            k, v = self.model.context_kv(l, ctx, pos)
            self.cache.k[l][st.slot, :, start : start + n] = k[0].to(self.dtype)
            self.cache.v[l][st.slot, :, start : start + n] = v[0].to(self.dtype)
        st.n_obs = start + n

    def block_logits(self, slots: list[int], anchors: list[int], anchor_ids: list[int]) -> torch.Tensor:
        """fp32 logits [B, S, Vd] of `block_states`."""
        return self.model.head_logits(self.block_states(slots, anchors, anchor_ids))

    def block_states(self, slots: list[int], anchors: list[int], anchor_ids: list[int]) -> torch.Tensor:
        """One forward for a batch of blocks: sequence b's anchor token anchor_ids[b] at position
        anchors[b] (its context: cache rows 0 .. anchors[b] - 1 of slot slots[b]). Returns the
        post-norm states [B, S, H]."""
        S = self.model.config.block_size
        dev = self.device
        anchors_t = torch.tensor(anchors, device=dev)  # [B]
        block = self.model.block_input(torch.tensor(anchor_ids, device=dev))  # [B, S]
        pos = anchors_t[:, None] + torch.arange(S, device=dev)  # [B, S]
        sl = torch.tensor(slots, device=dev)
        j = torch.arange(int(anchors_t.max()), device=dev)
        mask = torch.cat([(j[None, :] < anchors_t[:, None])[:, None, :].expand(-1, S, -1),
                          torch.ones(len(slots), S, S, dtype=torch.bool, device=dev)], -1)[:, None]  # [B, 1, S, P + S]

        def make_kv(l):
            def kv(k, v):  # k, v [B, kvh, S, hd]: the block's; the context's come from the cache
                K = self.cache.k[l][sl[:, None], :, j[None, :]].permute(0, 2, 1, 3)  # [B, kvh, P, hd]
                V = self.cache.v[l][sl[:, None], :, j[None, :]].permute(0, 2, 1, 3)
                return torch.cat([K.to(k.dtype), k], 2), torch.cat([V.to(v.dtype), v], 2), mask
            return kv

        return self.model.run_block(block, pos, [make_kv(l) for l in range(len(self.model.layers))], self.dtype)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        S = self.model.config.block_size
        idx = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k > 0 and self._ready(s)]
        if not idx:
            return drafts
        run = [seqs[i] for i in idx]
        budgets = [min(ks[i], S - 1) for i in idx]
        logits = self.block_logits([s.drafter_state.slot for s in run], [len(s.tokens) - 1 for s in run],
                                   [s.tokens[-1] for s in run])
        # slots 1..k: the distributions of draft depths 1..k, over the draft vocabulary [k, Vd]
        out = expand.draft_parallel(run, budgets, [logits[b, 1 : 1 + k] for b, k in enumerate(budgets)], self.columns)
        for b, i in enumerate(idx):
            drafts[i] = out[b]
        return drafts

    def _ready(self, s: Sequence) -> bool:
        """The context reaches the anchor (the last committed token, whose state comes next)."""
        st = self._state(s)
        p = len(s.tokens) - 1
        return p >= 1 and st.n_obs >= p

    def release(self, seq: Sequence) -> None:
        if seq.drafter_state is not None:
            self.cache.free(seq.drafter_state.slot)
            seq.drafter_state = None


def is_dflash_dir(path: str) -> bool:
    return DFlashModel.is_checkpoint(path)


def make_dflash_drafter(path: str, target, max_batch: int, max_len: int, dtype, device) -> DFlashDrafter:
    model = load_dflash(path, target, dtype=target.dtype).to(device)
    prepack_head(model)  # bf16 on a CPU with bf16 arithmetic: oneDNN's blocked layout
    model.set_embedding(target.model.embed_tokens.weight)
    return DFlashDrafter(model, target, max_batch, max_len, name=f"dflash:{path}")


@register("dflash", "dflash:DIR (or a bare DIR)", "a DFlash block drafter (speculators format)",
          detect=lambda p: is_dflash_dir(p))
def _make(arg: str, ctx) -> DFlashDrafter:
    try:
        return make_dflash_drafter(arg, ctx.target, ctx.max_batch, ctx.max_len, ctx.dtype, ctx.device)
    except CheckpointError as e:
        raise ValueError(str(e)) from e


__all__ = ["DFlashConfig", "DFlashModel", "DFlashDrafter", "default_dflash_layers", "load_dflash", "is_dflash_dir",
           "make_dflash_drafter"]
