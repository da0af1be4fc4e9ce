"""Weight-only int8 and int4 quantization of a target's projections and LM head.

Decoding one token reads every weight once, so its speed is set by the bytes of weights read
(the 262,144 x 640 LM head of Gemma 3 270M alone is 335 MB in bf16). Storing the weights as int8
(per output row scale) or int4 (groups of INT4_GROUP along the input, a scale and a zero each)
halves or quarters those bytes; activations stay in the model dtype.

For bf16 activations on a CPU the kernels are verispec's (kernels/int8_gemm.c, int4_gemm.c: one
contiguous stream of codes per 64 output rows, each output row computed on its own); elsewhere
torch's packed CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`),
which also fix a CPU problem of bf16 weights: on a CPU without bf16 arithmetic (no AVX512-BF16 /
AMX) a bf16 GEMM of more than one row costs 4-6x a one-row GEMV, while these kernels cost about
the same for 1 to 4 rows (measured on the 2-core dev machine: LM head, 1 row / 4 rows: bf16
24 / 105 ms, int8 14 / 19 ms, int4 10 / 13 ms). Both compute each output row on its own, so a
row's bits do not depend on how many rows share the call (tests/test_quant.py checks it bit for
bit): speculative verification stays lossless against plain decoding on the same weights.

Where a kernel is missing (other devices, shapes it does not take), the quantized weight is
de-quantized once and run as an ordinary dense weight: the same numbers, without the speed.
Losslessness is relative to the model as run: the quantized model's own plain decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels

from ..options import QUANT_MODES  # ("none", "int8", "int4"), defined where the CLI (no torch) reads it
INT4_GROUP = 32  # input columns per int4 scale/zero pair
INT4_N_MULTIPLE = 16  # the int4 CPU kernel packs output rows in tiles of 16
INT4_FIT_ROUNDS = 4  # least-squares refits of each group's grid (below)
INT4_ROWS = 8192  # rows fitted at a time (the LM head has 262,144)


def _fit_int4(g: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 16-level grid w ~ (q - 8) * scale + zero of each group g [N, G, gs] (fp32), with the
    least squared error we find: start from the group's [min, max], then alternate the codes q
    (rounding, the best for a fixed grid) with a least-squares fit of (scale, zero) to those codes
    (the best for fixed codes); each round can only lower the error, and the best round's grid is
    kept, after rounding scale and zero to `dtype` as the kernel reads them.
    Returns scale, zero [N, G, 1] in dtype and q [N, G, gs] in 0..15 (as float)."""
    n = g.shape[-1]
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale, offset = ((hi - lo) / 15).clamp(min=1e-12), lo  # w ~ q * scale + offset, q in 0..15
    best = None
    for _ in range(INT4_FIT_ROUNDS + 1):
        s, z = scale.to(dtype), (offset + 8 * scale).to(dtype)  # as stored
        q = ((g - z.float()) / s.float() + 8).round().clamp(0, 15)
        err = ((q - 8) * s.float() + z.float() - g).pow(2).sum(-1, keepdim=True)  # [N, G, 1]
        if best is None:
            best = [s, z, q, err]
        else:
            better = err < best[3]
            best = [torch.where(better, new, old) for new, old in zip((s, z, q, err), best)]
        sq, sqq = q.sum(-1, keepdim=True), q.pow(2).sum(-1, keepdim=True)
        sw, sqw = g.sum(-1, keepdim=True), (q * g).sum(-1, keepdim=True)
        det = n * sqq - sq * sq
        ok = det > 0  # a group whose codes are all equal keeps its grid
        fit_scale = (n * sqw - sq * sw) / det.clamp(min=1e-12)
        ok &= fit_scale > 0
        scale = torch.where(ok, fit_scale, scale)
        offset = torch.where(ok, (sw - scale * sq) / n, offset)
    return best[0], best[1], best[2]


class PackedWeight:
    """A weight [N, K] stored quantized; `mm(x [M, K]) -> [M, N]` in x's dtype.

    int8: w = q * scale[n], q in [-127, 127] (symmetric, one scale per output row).
    int4: w = (q - 8) * scale[n, g] + zero[n, g], q in [0, 15], g = k // INT4_GROUP (asymmetric;
          each group's grid fitted by `_fit_int4`).
    """

    def __init__(self, weight: torch.Tensor, mode: str, group_size: int = INT4_GROUP):
        if mode not in ("int8", "int4"):
            raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANT_MODES)}")
        self.mode, self.group_size = mode, group_size
        self.shape = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        w = weight.detach().float()  # [N, K]
        N, K = w.shape
        self.native = None  # verispec's kernel (kernels/int8_gemm.c, int4_gemm.c), for bf16 on CPU where it builds
        if mode == "int8":
            scale = (w.abs().amax(1) / 127).clamp(min=1e-12).to(self.dtype)  # [N], rounded as the kernel reads it
            self.q = (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)  # [N, K]
            self.scale = scale
            self.kernel = self.device.type == "cpu" and self.dtype != torch.float16
            if self.kernel and self.dtype == torch.bfloat16:
                self.native = kernels.int8_gemm()
                if self.native is not None:
                    self.packed = kernels.pack_int8(self.q)
                    del self.q  # the packed copy holds the codes (`codes`)
        else:
            if K % group_size:
                raise ValueError(f"int4 needs the input width ({K}) to be a multiple of the group size {group_size}")
            parts = [_fit_int4(c.reshape(-1, K // group_size, group_size), self.dtype) for c in w.split(INT4_ROWS)]
            scale, zero, q = (torch.cat(t) for t in zip(*parts))  # [N, G, 1] x 2, [N, G, gs]
            self.q = q.reshape(N, K).to(torch.uint8)  # unpacked codes, kept for de-quantizing
            self.scale, self.zero = scale[..., 0], zero[..., 0]  # [N, G]
            self.kernel = self.device.type == "cpu" and self.dtype != torch.float16 and N % INT4_N_MULTIPLE == 0
            if self.device.type == "cpu" and self.dtype == torch.bfloat16 and group_size == kernels.INT4_GROUP:
                self.native = kernels.int4_gemm()
            if self.native is not None:
                self.kernel = True
                self.packed = kernels.pack_int4(self.q)
                self.scales, self.zeros = kernels.pack_int4_groups(self.scale), kernels.pack_int4_groups(self.zero)
                del self.q  # the packed copy holds the codes (`codes`)
            elif self.kernel:
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32), 1)
                # [G, N, 2]: (scale, zero) per group, the layout the kernel reads
                self.scales_and_zeros = torch.stack([self.scale, self.zero], -1).transpose(0, 1).contiguous()
                del self.q
        self.dense = None if self.kernel else self.dequantize()

    def dequantize(self) -> torch.Tensor:
        """The weight as the model runs it, [N, K] in the model dtype (for tests and reference
        forwards; a packed int4 weight is read back through its kernel, rounded to the model dtype)."""
        if self.mode == "int8":
            return (self.codes().float() * self.scale.float()[:, None]).to(self.dtype)
        N, K = self.shape
        if self.native is not None:
            q = self.codes().float().reshape(N, K // self.group_size, self.group_size)
            return ((q - 8) * self.scale.float()[..., None] + self.zero.float()[..., None]).reshape(N, K).to(self.dtype)
        if getattr(self, "q", None) is None:  # the codes were packed away: x = I gives W.T
            eye = torch.eye(K, dtype=self.dtype, device=self.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size,
                                                              self.scales_and_zeros).t().contiguous()
        q = self.q.float().reshape(N, K // self.group_size, self.group_size)
        w = (q - 8) * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.reshape(N, K).to(self.dtype)

    def codes(self) -> torch.Tensor:
        """The codes [N, K]: int8, or int4 as uint8 0..15."""
        if self.native is None:
            return self.q
        unpack = kernels.unpack_int8 if self.mode == "int8" else kernels.unpack_int4
        return unpack(self.packed, self.shape[0])

    def mm(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [M, K] -> x @ W.T [M, N]; rows independent of M on the kernel path."""
        if self.dense is not None:
            from .layers import linear

            return linear(x, self.dense, None, invariant)
        if self.mode == "int8":
            if self.native is not None:
                return kernels.run_int8_gemm(self.native, x.to(torch.bfloat16).contiguous(), self.packed, self.scale,
                                             self.shape[0])
            return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        if self.native is not None:
            return kernels.run_int4_gemm(self.native, x.to(torch.bfloat16).contiguous(), self.packed, self.scales,
                                         self.zeros, self.shape[0])
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads for this weight."""
        if self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        if self.mode == "int8":
            return self.shape[0] * self.shape[1] + self.scale.numel() * self.scale.element_size()
        if self.native is not None:
            return self.packed.numel() + 2 * self.scales.numel() * self.scales.element_size()
        return self.packed.numel() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()


def quantize_model(model, mode: str, group_size: int = INT4_GROUP):
    """Quantize the decoder projections and the LM head of a `CausalLM` in place (after it is on
    its device and fused). The token embedding stays in the model dtype (a lookup reads one row);
    norms and biases too. The dense projection weights are dropped."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    if mode == "none":
        return model
    if model.quant != "none":
        raise ValueError(f"the model is quantized already ({model.quant})")
    if model.prepacked:
        raise ValueError("the model is prepacked (bf16, prepack.py); quantize a model loaded with quant='none' before packing")
    if not getattr(model, "_fused", False):
        model.fuse()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv = (PackedWeight(attn.qkv[0], mode, group_size), attn.qkv[1])
        attn.out = (PackedWeight(attn.o_proj.weight, mode, group_size), attn.o_proj.bias)
        mlp.gate_up = (PackedWeight(mlp.gate_up[0], mode, group_size), mlp.gate_up[1])
        mlp.down = (PackedWeight(mlp.down_proj.weight, mode, group_size), mlp.down_proj.bias)
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            m.weight = nn.Parameter(torch.empty(0, dtype=model.dtype, device=model.device), requires_grad=False)
    model.packed_head = PackedWeight(model.head_weight(), mode, group_size)
    if not model.config.tie_word_embeddings:
        model.lm_head.weight = nn.Parameter(torch.empty(0, dtype=model.dtype, device=model.device), requires_grad=False)
    model.quant = mode
    return model


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads (projections and LM head; not the embedding table)."""
    total = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out = attn.out[0] if attn.out else attn.o_proj.weight
        down = mlp.down[0] if mlp.down else mlp.down_proj.weight
        total += sum(w.nbytes for w in (attn.qkv[0], out, mlp.gate_up[0], down))
    head = getattr(model, "packed_head", None)
    total += head.nbytes if head is not None else model.head_weight().nbytes
    return total
