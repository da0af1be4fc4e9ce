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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .paths import PathViews
from ..kv import KVCache


INVARIANT_ROWS = 64  # rows per GEMM call in invariant mode (bf16 CPU GEMM rows are count-invariant up to here)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T, choosing the fastest CPU kernel for decode-sized inputs.

    On CPU, bf16 `F.linear` with a handful of rows is 1.4-1.7x slower than `mv` (one row) or
    `weight @ x.T` (a few rows) on the same weights (measured on the 2-core dev machine).
    Large inputs (prefill) and other devices take the ordinary path.

    invariant=True takes a path whose result for a row does not depend on how many other rows are
    in the call nor where the row is (checked bit for bit in tests/test_exact_numerics.py): in
    bf16 `weight @ x.T`, a single row padded to two (no extra cost on this CPU: `mv` can round
    differently from the GEMM kernel, so it is not used), in fp32 one `mv` per row (MKL's fp32
    GEMM is not row-invariant, so verifying k + 1 rows then costs k + 1 weight reads). `F.linear`
    switches kernels with the row count, so without it the same token can round differently in
    a verify window than in a one-token decode step.
    """
    M = x.numel() // x.shape[-1]
    if not invariant and (x.device.type != "cpu" or x.dtype == torch.float32 or M > 16):
        return F.linear(x, weight, bias)
    x2 = x.reshape(M, x.shape[-1])
    if invariant and x.dtype == torch.float32:  # MKL's fp32 GEMM is not row-invariant: one GEMV per row
        y = torch.stack([torch.mv(weight, row) for row in x2])
    elif M == 1 and not invariant:
        y = torch.mv(weight, x2[0])[None]
    elif M == 1:  # one row goes through the same GEMM kernel as several (padded to two; same speed as mv)
        y = (weight @ torch.cat([x2, torch.zeros_like(x2)]).t())[:, :1].t().contiguous()
    elif invariant:  # row blocks of a fixed maximum size: oneDNN re-blocks K past ~78 rows, changing the bits
        y = torch.cat([(weight @ xb.t()).t() for xb in x2.split(INVARIANT_ROWS)]).contiguous()
    else:  # dense rows: elementwise ops that follow vectorize a transposed view differently
        y = (weight @ x2.t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fuse_rows(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights of several projections of the same input into one matrix, and
    make each module's weight a view into it (no extra memory; one matmul instead of several)."""
    w = torch.cat([m.weight.detach() for m in linears])
    b = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    i = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[i : i + n], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[i : i + n], requires_grad=False)
        i += n
    return w, b


class RMSNorm(nn.Module):
    """RMSNorm in fp32. Gemma scales by (1 + w) before casting back; Llama/Qwen cast, then scale by w."""

    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.type_as(x)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        hd = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * hd, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * hd, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * hd, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * hd, c.hidden_size, bias=c.attention_bias and c.model_type != "qwen2")
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c.rms_norm_eps, c.gemma_norms)
            self.k_norm = RMSNorm(hd, c.rms_norm_eps, c.gemma_norms)
        self.qkv: tuple | None = None  # fused (weight, bias) once `fuse()` ran
        self.invariant = False  # batch-invariant matmuls (exact mode)

    def fuse(self):
        self.qkv = fuse_rows(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, mask, k_cache, v_cache, slot_rows, kv_view):
        """x: [B, T, H]; cos/sin: [B, 1, T, hd]; mask: [B, 1, T, Lk] bool.

        k_cache/v_cache: [slots, kv_heads, max_len, hd] (written in place at `slot_rows`);
        kv_view(cache) -> [B, kv_heads, Lk, hd], the keys/values this batch attends to.
        """
        B, T, _ = x.shape
        c = self.c
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self.qkv is not None:
            q, k, v = linear(x, *self.qkv, self.invariant).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = (linear(x, m.weight, m.bias, self.invariant) for m in (self.q_proj, self.k_proj, self.v_proj))
        q = q.reshape(B, T, c.num_heads, c.head_dim).transpose(1, 2)  # [B, h, T, hd]
        k = k.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # contiguous q: the CPU flash kernel rounds a strided q differently from a dense one, which
        # would make a token's bits depend on the verify window width (T = 1 is always dense)
        q, k = _rotate(q, cos, sin).contiguous(), _rotate(k, cos, sin)
        slots, rows = slot_rows  # [B, T] each
        k_cache[slots, :, rows] = k.transpose(1, 2)  # [B, T, kvh, hd]
        v_cache[slots, :, rows] = v
        if isinstance(kv_view, PathViews):
            o = kv_view.attend(q, k_cache, v_cache, mask, self._attend)  # [B, T, h, hd]
        else:
            o = self._attend(q, kv_view(k_cache), kv_view(v_cache), mask).transpose(1, 2)  # [B, T, h, hd]
        return linear(o.reshape(B, T, -1), self.o_proj.weight, self.o_proj.bias, self.invariant)

    def _attend(self, q, K, V, mask):
        """q [B, h, T, hd], K/V [B, kvh, Lk, hd], mask [B, 1, T, Lk] bool -> [B, h, T, hd]."""
        c = self.c
        if c.attn_logit_softcap is not None:
            return _softcapped_attention(q, K, V, mask, c.attn_scale, c.attn_logit_softcap)
        pad = self.invariant and q.shape[2] == 1  # the CPU kernel has its own path for one query row
        if pad:
            q, mask = torch.cat([q, q], dim=2), torch.cat([mask, mask], dim=2)
        o = F.scaled_dot_product_attention(
            q, K, V, attn_mask=mask, scale=c.attn_scale, enable_gqa=c.num_heads != c.num_kv_heads
        )
        return o[:, :, :1] if pad else o


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _softcapped_attention(q, K, V, mask, scale, cap):
    rep = q.shape[1] // K.shape[1]
    K, V = K.repeat_interleave(rep, 1), V.repeat_interleave(rep, 1)
    w = (q @ K.transpose(-1, -2)) * scale
    w = torch.tanh(w / cap) * cap
    w = w.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return w @ V


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.gelu = c.activation == "gelu_tanh"
        self.gate_up: tuple | None = None
        self.invariant = False

    def fuse(self):
        self.gate_up = fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x):
        if self.gate_up is not None:
            g, u = linear(x, *self.gate_up, self.invariant).chunk(2, dim=-1)
        else:
            g = linear(x, self.gate_proj.weight, self.gate_proj.bias, self.invariant)
            u = linear(x, self.up_proj.weight, self.up_proj.bias, self.invariant)
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return linear(g * u, self.down_proj.weight, self.down_proj.bias, self.invariant)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        g = c.gemma_norms
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
        if g:  # Gemma: a norm after attention and around the MLP
            self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
            self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
        self.gemma = g

    def forward(self, x, cos, sin, mask, k_cache, v_cache, slot_rows, kv_view):
        a = self.self_attn(self.input_layernorm(x), cos, sin, mask, k_cache, v_cache, slot_rows, kv_view)
        if self.gemma:
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def set_batch_invariant(self, on: bool) -> "CausalLM":
        """Exact mode: every matmul gives a row the same bits whatever else is in the batch."""
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
        super()._apply(fn, recurse)
        if getattr(self, "_fused", False):
            self.fuse()
        self._rope_cache.clear()
        return self

    def load_state_dict(self, state_dict, strict=True, assign=False):
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
        logits = linear(h, self.head_weight(), None, self.invariant).float()
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _cos_sin(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables per layer kind, built once per device/dtype, indexed by positions [B, T]."""
        key = (kind, self.device, self.dtype)
        if key not in self._rope_cache:
            inv, scale = self.config.rope[kind]
            n = self._rope_len
            freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv.float()[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache[key] = (
                (emb.cos() * scale).to(self.device, self.dtype),
                (emb.sin() * scale).to(self.device, self.dtype),
            )
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
        logit_rows: torch.Tensor | None = None,  # [B, R] rows to compute logits for; None = all rows
        num_layers: int | None = None,  # run only the first N layers (layer-skip drafting)
        taps: tuple[int, ...] = (),  # layer outputs to return
        want_logits: bool = True,
        kv_len: int | None = None,  # attend over this many cache rows (static shapes); default max(start)+T
        paths: PathViews | None = None,  # token trees: each query attends its own path view (models/paths.py)
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
        if contiguous:
            s0 = slots[0]

            def kv_view(t):  # a view, no copy
                return t[s0 : s0 + B, :, :Lk]

        else:
            rows = torch.arange(Lk, device=dev)
            sl = torch.tensor(slots, device=dev)

            def kv_view(t):
                return t[sl[:, None], :, rows[None, :]].permute(0, 2, 1, 3)

        x = self.embed(input_ids)
        hidden = {}
        n = num_layers or self.config.num_layers
        cos_sin = {}
        for i in range(n):
            kind = self.config.rope_kinds[i]
            if kind not in cos_sin:
                cos_sin[kind] = self._cos_sin(kind, positions)
            cos, sin = cos_sin[kind]
            x = self.model.layers[i](
                x, cos, sin, masks[self.config.sliding_windows[i]], cache.k[i], cache.v[i], (slot_idx, new_rows),
                paths or kv_view,
            )
            if i in taps:
                hidden[i] = x
        h = self.model.norm(x)
        logits = None
        if want_logits:
            hl = h if logit_rows is None else h.gather(1, logit_rows.to(dev)[..., None].expand(-1, -1, h.shape[-1]))
            logits = self.lm_logits(hl)
        return ForwardOutput(logits, hidden, h)


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
