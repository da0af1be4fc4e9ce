"""Our forward for the Llama / Qwen2 / Qwen3 / Gemma 3 (text) families.

Parameter names follow transformers (`model.layers.3.self_attn.q_proj.weight`, ...) so a
transformers state dict loads with `load_state_dict` and nothing is renamed.

The forward is written for speculative decoding:
- new tokens are written into an engine-owned `KVCache` at rows `start + t`;
  the cache length is moved by the caller (commit / rollback), never here;
- any visibility mask over the new tokens (causal chain, or a token tree) and explicit RoPE
  positions, for a batch of sequences with different cache lengths;
- logits only for the rows asked for (prefill needs one row, verification all of them);
- hidden states of chosen layers (`taps`) for drafters that read them (EAGLE, MTP).

The layers themselves (attention, MLP, norms, the CPU matmul helper) are in `layers.py`, shared with
the EAGLE-3 and MTP draft heads; this file wires them to the engine's `KVCache`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig
from .paths import PathViews
from .layers import KV, DecoderLayer, RMSNorm, linear, rope_cos_sin
from ..kv import KVCache
from ..sampling import argmax

__all__ = ["CausalLM", "ForwardOutput", "linear"]  # linear: re-exported from layers


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norms)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, R, V] for the requested rows (fp32)
    hidden: dict[int, torch.Tensor]  # layer index -> [B, T, H] (output of that layer)
    last_hidden: torch.Tensor  # [B, T, H] after the final norm (what the LM head reads)


class CausalLM(nn.Module):
    """A decoder-only language model that reads and writes an external `KVCache`."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.model = Backbone(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self._rope_cache: dict = {}
        self._rope_len = 0  # RoPE table rows; grown by new_cache to the longest cache
        self.invariant = False
        self.quant = "none"  # none | int8 | int4 (quant.quantize_model)
        self.packed_head = None  # the quantized or prepacked LM head (quant.PackedWeight, prepack.PrepackedWeight)
        self.prepacked = False  # bf16 projections in oneDNN's blocked layout (prepack.py)
        self.greedy_head = None  # greedy tokens of the prepacked bf16 head from an int8 copy (greedy_head.py)

    def set_batch_invariant(self, on: bool) -> "CausalLM":
        """Exact mode: every matmul gives a row the same bits whatever else is in the batch. (The
        engine says it every step: setting 36 module attributes again cost 0.4 ms a step.)"""
        if on == self.invariant:
            return self
        self.invariant = on
        for layer in self.model.layers:
            layer.self_attn.invariant = layer.mlp.invariant = on
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def fuse(self) -> "CausalLM":
        """Fuse q/k/v and gate/up projections for inference (weights become views; names unchanged)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self._fused = True
        return self

    def _apply(self, fn, recurse=True):
        # .to()/.half() replace parameters; fused matrices are plain tensors, so rebuild them after
        if self.quant != "none" or self.prepacked:
            raise RuntimeError(f"a {'quantized' if self.quant != 'none' else 'prepacked'} model cannot be moved or "
                               f"cast; load it where it runs, in the dtype it runs in")
        super()._apply(fn, recurse)
        if getattr(self, "_fused", False):
            self.fuse()
        self._rope_cache.clear()
        return self

    def load_state_dict(self, state_dict, strict=True, assign=False):
        if self.quant != "none" or self.prepacked:
            raise RuntimeError("the weights of a quantized or prepacked model are packed; load the state into a fresh model")
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if getattr(self, "_fused", False):
            self.fuse()
        return out

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def new_cache(self, num_slots: int, max_len: int, num_layers: int | None = None) -> KVCache:
        """A KV cache for this model; positions up to max_len get RoPE entries."""
        c = self.config
        if max_len > self._rope_len:
            self._rope_len = max_len
            self._rope_cache.clear()
        return KVCache(
            num_layers or c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        return h

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., H] after the final norm -> fp32 logits [..., V]."""
        logits = linear(h, self.packed_head or self.head_weight(), None, self.invariant).float()
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_tokens(self, h: torch.Tensor) -> torch.Tensor | None:
        """h: [M, H] after the final norm -> the argmax of each row's `lm_logits` [M] (the same
        tokens, ties included) without fp32 logits: the greedy head where it reads less than the
        full head for M rows, else the argmax of the full head's output in its own dtype (widening
        bf16 to fp32 is exact, so the first largest entry is the same; at 64 rows the fp32 copy
        is 64 MB written and read again). None where the model caps its logits (tanh can round
        distinct logits to one value and move the first largest): take `lm_logits`."""
        if self.config.final_logit_softcap is not None:
            return None
        g = self.greedy_head
        if g is not None and h.shape[0] <= g.max_rows:
            best = g.tokens(h)
            if best is not None:
                return best
        return argmax(linear(h, self.packed_head or self.head_weight(), None, self.invariant))

    def _cos_sin(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables per layer kind, built once per device/dtype, indexed by positions [B, T]."""
        key = (kind, self.device, self.dtype)
        if key not in self._rope_cache:
            inv, scale = self.config.rope[kind]
            cos, sin = rope_cos_sin(inv, torch.arange(self._rope_len), scale)
            self._rope_cache[key] = (cos.to(self.device, self.dtype), sin.to(self.device, self.dtype))
        cos, sin = self._rope_cache[key]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [B, 1, T, hd]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        cache: KVCache,
        slots: list[int],  # cache slot of each sequence
        starts: torch.Tensor,  # [B] long: cache rows already filled (new tokens go to start + t)
        *,
        positions: torch.Tensor | None = None,  # [B, T] RoPE positions; default start + t
        tree_mask: torch.Tensor | None = None,  # [B, T, T] bool: new token t sees new token s; default causal
        paths: PathViews | None = None,  # token trees: each query attends its own path view (models/paths.py)
        logit_rows: torch.Tensor | None = None,  # [B, R] rows to compute logits for; None = all rows
        num_layers: int | None = None,  # run only the first N layers (layer-skip drafting)
        taps: tuple[int, ...] = (),  # layer outputs to return
        want_logits: bool = True,
        kv_len: int | None = None,  # attend over this many cache rows (static shapes); default max(start)+T
    ) -> ForwardOutput:
        B, T = input_ids.shape
        dev = self.device
        starts = starts.to(dev)
        new_rows = starts[:, None] + torch.arange(T, device=dev)  # [B, T]
        if positions is None:
            positions = new_rows
        Lk = kv_len or int(starts.max()) + T
        if paths is not None:
            masks = paths.masks(self.config.sliding_windows[: num_layers or self.config.num_layers])
        else:
            masks = _attention_masks(self.config, starts, positions, tree_mask, T, Lk, num_layers)

        slot_idx = torch.tensor(slots, device=dev)[:, None].expand(B, T)
        contiguous = slots == list(range(slots[0], slots[0] + B))
        s0 = slots[0] if contiguous else None
        # K/V the layers attend over: the batch's slots as one view when they are consecutive, else
        # every slot's first Lk rows with the slot of each batch entry (attention reads them in place)
        read_slots = None if contiguous else slot_idx[:, 0].contiguous()

        def kv_view(t):  # a view, no copy
            return t[s0 : s0 + B, :, :Lk] if contiguous else t[:, :, :Lk]

        flat = (slot_idx.reshape(-1).contiguous(), new_rows.reshape(-1).contiguous())  # [B * T] each, for native layers
        x = self.embed(input_ids)
        hidden = {}
        n = num_layers or self.config.num_layers
        cos_sin = {}
        for i in range(n):
            kind = self.config.rope_kinds[i]
            if kind not in cos_sin:
                cos_sin[kind] = self._cos_sin(kind, positions)
            cos, sin = cos_sin[kind]
            mask = masks[self.config.sliding_windows[i]]
            x = self.model.layers[i](x, cos, sin, _cache_kv(cache.k[i], cache.v[i], slot_idx, new_rows, kv_view, mask,
                                                            paths, read_slots, flat))
            if i in taps:
                hidden[i] = x
        h = self.model.norm(x)
        logits = None
        if want_logits:
            hl = h if logit_rows is None else h.gather(1, logit_rows.to(dev)[..., None].expand(-1, -1, h.shape[-1]))
            logits = self.lm_logits(hl)
        return ForwardOutput(logits, hidden, h)


def _cache_kv(k_cache, v_cache, slots, rows, kv_view, mask, paths: PathViews | None = None,
              read_slots: torch.Tensor | None = None, flat: tuple = ()) -> KV:
    """The target's `kv` for one layer: write the new keys/values at cache rows (slots, rows) [B, T]
    in place, attend over kv_view(cache) [B, kv_heads, Lk, hd] (or [S, ...] read at `kv.slots`
    [B]) with `mask` -- or, for token trees, over each query's path view (`kv.route`, which
    regroups the queries). `kv.cache` names the caches and each entry's (slot, row) as `flat`
    [B * T] int64 tensors, for a native layer (native_layer.py) that writes them itself and then
    calls `kv.read()`."""

    def read():
        if paths is not None:
            return paths.keys(k_cache), paths.keys(v_cache), mask
        return kv_view(k_cache), kv_view(v_cache), mask

    def kv(k, v):  # [B, kvh, T, hd]
        k_cache[slots, :, rows] = k.transpose(1, 2)
        v_cache[slots, :, rows] = v.transpose(1, 2)
        return read()

    kv.route = paths
    kv.slots = None if paths is not None else read_slots
    kv.read = read  # what to attend, once the keys and values are written (a native layer writes them)
    kv.cache = (k_cache, v_cache, *flat) if flat else None  # where: the caches, each entry's slot and row [B * T] int64
    return kv


def _attention_masks(c: ModelConfig, starts, positions, tree_mask, T, Lk, num_layers):
    """Boolean masks [B, 1, T, Lk], one per distinct sliding window among the layers that run.

    Key row j of sequence b holds a token at RoPE position j when j < start (committed tokens),
    or is new token s = j - start, at `positions[b, s]`.
    """
    dev = starts.device
    j = torch.arange(Lk, device=dev)
    rel = j[None, None, :] - starts[:, None, None]  # [B, 1, Lk]: index among new tokens
    t = torch.arange(T, device=dev)[None, :, None]  # [1, T, 1]
    if tree_mask is None:
        visible = rel <= t  # committed rows (rel < 0) and causal new rows
        key_pos = j[None, None, :].expand(starts.shape[0], 1, Lk)
    else:
        is_new = (rel >= 0) & (rel < T)
        idx = rel.clamp(0, T - 1).expand(-1, T, -1)
        visible = (rel < 0) | (is_new & tree_mask.to(dev).gather(2, idx))
        key_pos = torch.where(is_new, positions.gather(1, rel.clamp(0, T - 1)[:, 0]).unsqueeze(1), j)
    masks = {}
    n = num_layers or c.num_layers
    for w in set(c.sliding_windows[:n]):
        m = visible
        if w is not None:
            m = m & (key_pos > positions[:, :, None] - w)
        masks[w] = m.unsqueeze(1)
    return masks
