"""Decoder building blocks shared by the target forward (`model.py`) and the trained draft heads
(`drafters/eagle3.py`, `drafters/mtp.py`): the CPU matmul helper, RMSNorm, RoPE, attention, MLP and a
decoder layer, each configured by a `ModelConfig`.

Attention does not own a KV cache. Each call gets a `kv` callback,

    kv(k, v) -> (K, V, mask)    k, v [B, kv_heads, T, head_dim]: this call's keys/values (RoPE applied)
                                K, V [B, kv_heads, Lk, head_dim] and mask [B, 1, T, Lk] bool: what to attend

so the same module writes into the target's paged slots (`model.py`), into a drafter's own cache
(serving), or into a growing list of tensors that autograd can see (training-time-test unrolling).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .config import ModelConfig
from .prepack import PrepackedWeight
from .quant import PackedWeight

INVARIANT_ROWS = 64  # rows per GEMM call in invariant mode (bf16 CPU GEMM rows are count-invariant up to here)

KV = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T, choosing the fastest CPU kernel for decode-sized inputs.

    On a CPU without bf16 arithmetic, bf16 `F.linear` with a handful of rows is 1.4-1.7x slower than
    `mv` (one row) or `weight @ x.T` (a few rows) on the same weights (measured on the 2-core dev
    machine); with it (`bf16_native`), `F.linear` is the fastest and takes every non-invariant call.
    Large inputs (prefill), other devices, and mixed dtypes (a draft head trained under autocast,
    which only `F.linear` casts) take the ordinary path.

    A `PackedWeight` (int8/int4, quant.py) goes to its packed kernel, which computes every row on its
    own in any mode.

    invariant=True takes a path whose result for a row does not depend on how many other rows are
    in the call nor where the row is (checked bit for bit in tests/test_exact_numerics.py): in
    bf16 `weight @ x.T`, a single row padded to two (no extra cost on this CPU: `mv` can round
    differently from the GEMM kernel, so it is not used), in fp32 one `mv` per row (MKL's fp32
    GEMM is not row-invariant, so verifying k + 1 rows then costs k + 1 weight reads). `F.linear`
    switches kernels with the row count, so without it the same token can round differently in
    a verify window than in a one-token decode step.
    """
    M = x.numel() // x.shape[-1]
    if isinstance(weight, (PackedWeight, PrepackedWeight)):  # int8/int4 (quant.py), blocked bf16 (prepack.py)
        y = weight.mm(x.reshape(M, x.shape[-1]), invariant)
        y = y if bias is None else y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])
    if not invariant and x.dtype == torch.bfloat16 and x.device.type == "cpu" and bf16_native():
        return F.linear(x, weight, bias)  # oneDNN's bf16 kernels: 2-4x faster than mv for one row here
    if x.dtype != weight.dtype or (
        not invariant and (x.device.type != "cpu" or x.dtype == torch.float32 or M > 16)
    ):
        return F.linear(x, weight, bias)
    x2 = x.reshape(M, x.shape[-1])
    if invariant and x.dtype == torch.float32:  # MKL's fp32 GEMM is not row-invariant: one GEMV per row
        y = torch.stack([torch.mv(weight, row) for row in x2])
    elif M == 1 and not invariant:
        y = torch.mv(weight, x2[0])[None]
    elif invariant:  # row blocks of a fixed maximum size: oneDNN re-blocks K past ~78 rows, changing the bits
        y = torch.cat([_gemm_rows(weight, xb) for xb in x2.split(INVARIANT_ROWS)]).contiguous()
    else:  # dense rows: elementwise ops that follow vectorize a transposed view differently
        y = (weight @ x2.t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


_BF16_NATIVE: list[bool] = []


def bf16_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 / AMX): there `F.linear` (oneDNN) is
    the fastest bf16 kernel for any row count (one row, 8192 x 640: 0.45 ms against 1.8 ms for `mv`,
    on an AVX512-BF16 EPYC); without it, `mv` and `weight @ x.T` are (the CPUs the paths below were
    tuned on)."""
    if not _BF16_NATIVE:
        from ..preflight import cpu_has_bf16_arithmetic

        _BF16_NATIVE.append(bool(cpu_has_bf16_arithmetic()))
    return _BF16_NATIVE[0]


MIN_GEMM_ROWS = 4  # invariant blocks are padded to at least this many rows (see `_gemm_rows`)


def _gemm_rows(weight: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """(weight @ xb.T).T; fewer than MIN_GEMM_ROWS rows are padded with zero rows so that they go through
    the same GEMM kernel as several (at no cost: decode-sized GEMMs are bound by the weight reads).
    One row and two take other kernels than three or more: with a [32, 64] weight (a tiny test
    model's value projection) two rows rounded differently from the same rows among four."""
    n = xb.shape[0]
    if n < MIN_GEMM_ROWS:
        return (weight @ torch.cat([xb, xb.new_zeros(MIN_GEMM_ROWS - n, xb.shape[1])]).t())[:, :n].t()
    return (weight @ xb.t()).t()


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
    """RMSNorm in fp32. Gemma scales by (1 + w) before casting back; Llama/Qwen cast, then scale by w.

    A decode step runs 109 norms on Gemma 3 270M (4 per layer, q/k norms, the final one), each on
    a row or a few, so dispatch is what they cost: `F.rms_norm` on CPU is itself a chain of about
    ten small operators. At inference on bf16 CPU tensors the norm is one call to rms_norm.c
    (verispec/kernels) where it builds, with the same roundings; training takes `F.rms_norm`.
    `residual`: return residual + norm(x) (one call on the native path)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self._scale: tuple | None = None  # (weight version, pointer, fp32 scale) for the native kernel

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled():
            fn = kernels.rms_norm()
            if fn is not None:
                return kernels.run_rms_norm(fn, x, self.fp32_scale(), self.eps, self.gemma,
                                            None if residual is None else residual.contiguous())
        shape = (x.shape[-1],)
        if self.gemma:
            y = F.rms_norm(x.float(), shape, 1.0 + self.weight.float(), self.eps).type_as(x)
        else:
            y = self.weight * F.rms_norm(x.float(), shape, None, self.eps).type_as(x)
        return y if residual is None else residual + y

    def fp32_scale(self) -> torch.Tensor:
        """(1 + w) for Gemma, w otherwise, in fp32: computed once per weight value. (A weight made
        under inference mode has no version counter; it can change in place only inside inference
        mode, which loading is, so such a weight is known by its storage alone.)"""
        w = self.weight
        key = (None if w.is_inference() else w._version, w.data_ptr())
        if self._scale is None or self._scale[:2] != key:
            scale = (1.0 + w.detach().float()) if self.gemma else w.detach().float()
            self._scale = (*key, scale.contiguous())
        return self._scale[2]


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables in fp32: positions [...] -> cos, sin [..., head_dim] (angles position * inv_freq)."""
    f = positions.float()[..., None] * inv_freq.float().to(positions.device)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd] -> rotated, dense [B, heads, T, hd]; cos/sin [B, 1, T, hd]. At inference
    on bf16 CPU tensors one call to kernels/rope.c (torch's roundings, `rotate`'s seven operators
    and the copy in one), else `rotate`. Dense because the CPU flash kernel rounds a strided q
    differently from a dense one, which would make a token's bits depend on the verify window width."""
    if (x.dtype == cos.dtype == torch.bfloat16 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and x.requires_grad)):
        fn = kernels.rope()
        if fn is not None:
            return kernels.run_rope(fn, x, cos, sin)
    return rotate(x.transpose(1, 2), cos, sin).contiguous()


def grouped_attention(q, K, V, mask, scale: float, softcap: float | None = None,
                      slots: torch.Tensor | None = None) -> torch.Tensor:
    """Attention as two batched matmuls, the query heads of a KV group stacked as rows:
    q [B, h, T, hd], K/V [B, kvh, Lk, hd], mask [B, 1, T, Lk] bool -> [B, h, T, hd]; scores and
    softmax in fp32. With `slots` [B], K/V are the cache's [S, kvh, Lk, hd] and batch entry b
    attends entry slots[b] (the native kernel reads it in place; a copy of those entries otherwise).

    The CPU path for bf16/fp16. PyTorch's CPU flash kernel is slow there for decode shapes (Gemma
    3 270M, h 4, kvh 1, hd 256, 512 keys, on the AVX512-BF16 EPYC: one query at batch 64 38.5 ms
    against 3.1 ms here, batch 8 5.0 against 0.36 ms; a 256-token prefill in query pairs 32 against
    4.7 ms; benchmarks/attention_kernels.py) and it rounds a row differently with the number of
    queries in the call. These matmuls
    give a row the same bits for any query count, batch and key padding (tests/test_exact_numerics.py),
    so invariant mode needs no splitting; a lone query row (T = 1 without GQA) is padded to two, to
    stay on the GEMM kernel rather than a GEMV.

    At inference on bf16 tensors it is verispec's attention.c instead, where the kernels build: on
    CPUs without bf16 arithmetic the batched matmuls above are not row-invariant (on an Ice Lake
    Xeon a row rounds differently among 16 rows than among 2, and over 1,536 keys than over 1,024
    with the extra weights zero), while the kernel computes each query row alone from its unmasked
    keys, with the same roundings as the matmuls."""
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or K.requires_grad or V.requires_grad)
    if q.dtype == torch.bfloat16 and K.dtype == V.dtype == q.dtype and not needs_grad:
        fn = kernels.attention()
        if fn is not None:
            return kernels.run_attention(fn, q, K, V, mask, scale, softcap, slots)
    if slots is not None:
        K, V = K[slots], V[slots]
    B, h, T, hd = q.shape
    kvh = K.shape[1]
    g = h // kvh
    pad = g * T == 1
    if pad:
        q, mask, T = torch.cat([q, q], 2), torch.cat([mask, mask], 2), 2
    # the GEMM's bits depend on the operands' row strides: keys and values as dense rows, always
    # (the cache's own [Lk, hd] blocks are; a tree's gathered path views are strided)
    K, V = (t if t.stride(-1) == 1 and t.stride(-2) == hd else t.contiguous() for t in (K, V))
    qg = q.reshape(B, kvh, g * T, hd)  # [B, kvh, g*T, hd]: a group's heads as rows
    s = (qg @ K.transpose(-1, -2)).float() * scale  # [B, kvh, g*T, Lk]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.reshape(B, kvh, g, T, -1).masked_fill(~mask[:, :, None], float("-inf"))  # mask [B, 1, 1, T, Lk]
    w = s.softmax(-1).to(q.dtype).reshape(B, kvh, g * T, -1)
    o = (w @ V).reshape(B, h, T, hd)
    return o[:, :, :1] if pad else o


INVARIANT_QUERIES = 2  # fp32 SDPA queries per call in invariant mode (see `attend`)


def attend(q, K, V, mask, scale: float, softcap: float | None = None, invariant: bool = False,
           slots: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, h, T, hd], K/V [B, kvh, Lk, hd] (or [S, kvh, Lk, hd] read at entries `slots` [B]),
    mask [B, 1, T, Lk] bool -> [B, h, T, hd].

    bf16/fp16 on CPU, and soft-capped logits anywhere, take `grouped_attention` (row-invariant as it
    is). Otherwise SDPA; with invariant=True in fp32 every call holds exactly two queries, the shape
    a lone query is padded to, because the CPU kernel computes a row differently with the number of
    queries in the call and has its own path for one query."""
    if softcap is not None or (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)):
        return grouped_attention(q, K, V, mask, scale, softcap, slots)
    if slots is not None:
        K, V = K[slots], V[slots]
    if not invariant:
        return _sdpa(q, K, V, mask, scale)
    outs = []
    for qb, mb in zip(q.split(INVARIANT_QUERIES, dim=2), mask.split(INVARIANT_QUERIES, dim=2)):
        if qb.shape[2] < INVARIANT_QUERIES:
            outs.append(_sdpa(torch.cat([qb, qb], 2), K, V, torch.cat([mb, mb], 2), scale)[:, :, :1])
        else:
            outs.append(_sdpa(qb.contiguous(), K, V, mb, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def _sdpa(q, K, V, mask, scale):
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != K.shape[1])


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE, optional q/k norms and soft-capping.

    `in_dim` (default the hidden size) is the width q/k/v read: EAGLE-3's first draft layer reads
    concat(embedding, hidden state), twice the hidden size.
    """

    def __init__(self, c: ModelConfig, in_dim: int | None = None):
        super().__init__()
        self.c = c
        hd, d = c.head_dim, in_dim or c.hidden_size
        self.q_proj = nn.Linear(d, c.num_heads * hd, bias=c.attention_bias)
        self.k_proj = nn.Linear(d, c.num_kv_heads * hd, bias=c.attention_bias)
        self.v_proj = nn.Linear(d, c.num_kv_heads * hd, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * hd, c.hidden_size, bias=c.attention_bias and c.model_type != "qwen2")
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c.rms_norm_eps, c.gemma_norms)
            self.k_norm = RMSNorm(hd, c.rms_norm_eps, c.gemma_norms)
        self.qkv: tuple | None = None  # fused (weight, bias) once `fuse()` ran
        self.out: tuple | None = None  # (weight, bias) of o_proj once quantized (quant.py)
        self.invariant = False  # batch-invariant matmuls (exact mode)

    def fuse(self):
        self.qkv = fuse_rows(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KV) -> torch.Tensor:
        """x: [B, T, in_dim]; cos/sin: [B, 1, T, hd]; kv: see the module docstring."""
        B, T, _ = x.shape
        c = self.c
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self.qkv is not None:
            q, k, v = linear(x, *self.qkv, self.invariant).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = (linear(x, m.weight, m.bias, self.invariant) for m in (self.q_proj, self.k_proj, self.v_proj))
        q = q.reshape(B, T, c.num_heads, c.head_dim)  # [B, T, h, hd]
        k = k.reshape(B, T, c.num_kv_heads, c.head_dim)  # [B, T, kvh, hd]
        if c.qk_norm:  # per head: on the split views, before the transpose (the native norm reads them in place)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_heads(q, cos, sin), rope_heads(k, cos, sin)  # [B, h, T, hd] dense, [B, kvh, T, hd]
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        o = self.attend_cached(q, *kv(k, v), kv)
        out = self.out or (self.o_proj.weight, self.o_proj.bias)
        return linear(o.transpose(1, 2).reshape(B, T, -1), *out, self.invariant)

    def attend_cached(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor, kv: KV) -> torch.Tensor:
        """q [B, h, T, hd] against what `kv` returned (K, V, mask) -> o [B, h, T, hd], token trees
        routed through their path views (models/paths.py)."""
        if K.dtype != q.dtype or V.dtype != q.dtype:  # autocast training: rotated q/k fp32, v bf16
            K, V = K.to(q.dtype), V.to(q.dtype)
        B, _, T, _ = q.shape
        route = getattr(kv, "route", None)  # token trees: queries regrouped into path views
        if route is not None:
            q = route.gather_queries(q)
        o = attend(q, K, V, mask, self.c.attn_scale, self.c.attn_logit_softcap, self.invariant, getattr(kv, "slots", None))
        return o if route is None else route.scatter_outputs(o, B, T)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.gelu = c.activation == "gelu_tanh"
        self.gate_up: tuple | None = None
        self.down: tuple | None = None  # (weight, bias) of down_proj once quantized (quant.py)
        self.invariant = False

    def fuse(self):
        self.gate_up = fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x):
        if self.gate_up is not None:
            g, u = linear(x, *self.gate_up, self.invariant).chunk(2, dim=-1)
        else:
            g = linear(x, self.gate_proj.weight, self.gate_proj.bias, self.invariant)
            u = linear(x, self.up_proj.weight, self.up_proj.bias, self.invariant)
        down = self.down or (self.down_proj.weight, self.down_proj.bias)
        return linear(self.activate(g, u), *down, self.invariant)

    def activate(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """act(g) * u. (A native layer computes its own in kernels/layer.c: the exact value rounded,
        but within 1e-6 of a bf16 tie, where torch's Sleef-based one may round the other way too.)"""
        return (F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)) * u


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: Llama / Qwen (2 norms), or Gemma (a norm after attention and around the MLP)."""

    def __init__(self, c: ModelConfig, attn_in: int | None = None):
        super().__init__()
        self.self_attn = Attention(c, attn_in)
        self.mlp = MLP(c)
        g = c.gemma_norms
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
        if g:
            self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
            self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
        self.gemma = g

    def native(self):
        """This layer's native form (native_layer.py) for its current weights, or None."""
        from .native_layer import native_for

        return native_for(self)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KV) -> torch.Tensor:
        cache = getattr(kv, "cache", None)  # where kv writes: the target's KV cache (model.py)
        if cache is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled():
            native = self.native()
            if native is not None and x.is_contiguous():
                q = native.pre(x, cos, sin, cache)
                return native.post(self.self_attn.attend_cached(q, *kv.read(), kv), x)
        a = self.self_attn(self.input_layernorm(x), cos, sin, kv)
        if self.gemma:
            x = self.post_attention_layernorm(a, residual=x)
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)), residual=x)
        return self.residual_mlp(x + a)

    def residual_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The second half of a Llama-style layer: x + mlp(post_attention_layernorm(x))."""
        return x + self.mlp(self.post_attention_layernorm(x))
