"""bf16 weights in a blocked layout, for decode-sized matmuls on CPUs.

A decode step multiplies a handful of rows by every weight once, so it should be bound by reading
the weights. With a plain row-major bf16 weight it is not: on the 2-core AVX512-BF16 EPYC, Gemma 3
270M's 262,144 x 640 LM head (335 MB) takes 29 ms through `F.linear` for one row and 38 ms through
`weight @ x.T` for the few rows of a verify window, where summing the same bytes takes 10 ms; on
an Ice Lake Xeon without bf16 arithmetic 23 ms for one row and 66 ms for four.

Two kernels run a `PrepackedWeight`:
- verispec's own (kernels/bf16_gemm.c), where it builds (x86-64 with AVX2 + FMA, a C compiler):
  64-row groups interleaved by column pairs, one fp32 lane per output (AVX512-BF16 dot products,
  or widened bf16 and fused multiply-adds on AVX512 / AVX2); on the EPYC 27-43 GB/s at 1-4 rows
  against 12-20 for oneDNN, on the Xeon 19-22 against 7-18 for the LM head. Each row is computed
  alone, so its bits do not depend on the rest of the call (batch invariance by construction);
- otherwise, on a CPU with bf16 arithmetic, oneDNN's blocked layout (`mkldnn._reorder_linear_weight`,
  `mkldnn._linear_pointwise`).
  For inputs wider than 1,024 it computes a lone row differently from two or more, while every
  call of 2 to 64 rows gives each row the bits it has in any other such call (checked for widths
  640-4,096 and 2-64 rows). So its invariant calls pad a lone row to two and cut wider inputs into
  blocks of at most `layers.INVARIANT_ROWS` rows; ordinary calls go to the kernel as they are.
Either way `can_prepack` checks a small version of the row-invariance once per process before
anything is prepacked (those measurements are of one CPU and library version).
"""

from __future__ import annotations

import torch
from torch import nn

_ROWS_INVARIANT: list[bool] = []


def can_prepack(dtype: torch.dtype, device) -> bool:
    """bf16 on a CPU where verispec's kernel builds (AVX2 and up), or else one that multiplies bf16
    in hardware for oneDNN (elsewhere its blocked kernels are not measured); and where a probe finds
    the invariant path's rows independent of the row count (`rows_invariant_here`): a CPU whose
    oneDNN picks its kernels otherwise (AMX tiles, another version) keeps the row-major path rather
    than risk speculative output differing from plain."""
    from ..kernels import bf16_gemm
    from .layers import bf16_native

    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    onednn = bf16_native() and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (bf16_gemm() is not None or onednn) and rows_invariant_here()


def rows_invariant_here() -> bool:
    """Once per process: do invariant `PrepackedWeight.mm` calls of 2 to 70 rows give every row the
    bits it has alone, for an input of 640 and one of 2,048 (either side of the width where oneDNN
    treats a lone row differently)? About 20 ms."""
    if not _ROWS_INVARIANT:
        g = torch.Generator().manual_seed(0)
        ok = True
        with torch.inference_mode():
            for n, k in ((256, 640), (256, 2048)):
                pw = PrepackedWeight(torch.randn(n, k, generator=g).bfloat16())
                X = torch.randn(70, k, generator=g).bfloat16()
                alone = torch.cat([pw.mm(X[i : i + 1], invariant=True) for i in range(len(X))])
                ok &= all(torch.equal(pw.mm(X[:m], invariant=True), alone[:m]) for m in (2, 3, 5, 16, 17, 33, 64, 65, 70))
        _ROWS_INVARIANT.append(ok)
    return _ROWS_INVARIANT[0]


class PrepackedWeight:
    """A bf16 weight [N, K] (and bias [N]) reordered for a decode-sized kernel; `mm(x [M, K]) -> [M, N]`.

    The kernel is verispec's own (kernels/bf16_gemm.c) where it builds, else oneDNN's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        from ..kernels import bf16_gemm, pack_bf16

        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"prepacking takes a 2-d bf16 CPU weight, not {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device
        self.nbytes = weight.numel() * weight.element_size()
        self.native = bf16_gemm()
        if self.native is not None:
            self.packed = pack_bf16(weight)
            self.bias = None if bias is None else bias.detach().float().contiguous()
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)  # batch-size hint 1
            self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def mm(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [M, K] (bf16) -> x @ W.T + b [M, N]; invariant: each row's bits independent of M."""
        if x.dtype != torch.bfloat16:
            raise TypeError(f"a prepacked bf16 weight multiplies bf16 inputs, not {x.dtype}")
        x = x.contiguous()
        if self.native is not None:  # every row on its own in any call: invariant as it is
            from ..kernels import run_bf16_gemm

            return run_bf16_gemm(self.native, x, self.packed, self.bias, self.shape[0])
        if not invariant:
            return self._call(x)
        if x.shape[0] == 1:
            return self._call(torch.cat([x, torch.zeros_like(x)]))[:1]
        from .layers import INVARIANT_ROWS

        return torch.cat([self._call(b) for b in x.split(INVARIANT_ROWS)])


def prepack_model(model):
    """Reorder the decoder projections and the LM head of a fused bf16 `CausalLM` in place. The
    projections' dense weights are dropped; the LM head's stays (it is the embedding table when
    tied, and drafter training reads the target's head rows). The model can no longer be moved or
    cast (load it where it runs)."""
    if model.quant != "none" or getattr(model, "prepacked", False):
        raise ValueError(f"the model's weights are packed already ({model.quant if model.quant != 'none' else 'bf16'})")
    if not getattr(model, "_fused", False):
        model.fuse()
    empty = lambda: nn.Parameter(torch.empty(0, dtype=model.dtype, device=model.device), requires_grad=False)  # noqa: E731
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv = (PrepackedWeight(*attn.qkv), None)
        attn.out = (PrepackedWeight(attn.o_proj.weight, attn.o_proj.bias), None)
        mlp.gate_up = (PrepackedWeight(*mlp.gate_up), None)
        mlp.down = (PrepackedWeight(mlp.down_proj.weight, mlp.down_proj.bias), None)
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            m.weight = empty()
    model.packed_head = PrepackedWeight(model.head_weight())  # the dense head stays: drafter training reads its rows
    if model.packed_head.native is not None and model.config.final_logit_softcap is None:
        from .greedy_head import GreedyHead

        model.greedy_head = GreedyHead.build(model.head_weight(), model.packed_head)
    model.prepacked = True
    return model


def prepack_head(head):
    """A draft head at serving time (drafters/head.py `DraftHead`), where its dtype and device allow:
    the projections of its decoder layers and its LM head run prepacked. The dense weights stay
    (a head is a few MB, and some drafters read a projection's weight directly, e.g. DFlash's
    context keys). Returns the head."""
    from .layers import MLP, Attention

    if not can_prepack(head.lm_head.weight.dtype, head.lm_head.weight.device):
        return head
    for m in head.modules():
        if isinstance(m, Attention):
            projs = (m.q_proj, m.k_proj, m.v_proj)
            bias = torch.cat([p.bias for p in projs]) if m.q_proj.bias is not None else None
            m.qkv = (PrepackedWeight(torch.cat([p.weight for p in projs]), bias), None)
            m.out = (PrepackedWeight(m.o_proj.weight, m.o_proj.bias), None)
        elif isinstance(m, MLP):
            bias = torch.cat([m.gate_proj.bias, m.up_proj.bias]) if m.gate_proj.bias is not None else None
            m.gate_up = (PrepackedWeight(torch.cat([m.gate_proj.weight, m.up_proj.weight]), bias), None)
            m.down = (PrepackedWeight(m.down_proj.weight, m.down_proj.bias), None)
    head.packed_head = PrepackedWeight(head.lm_head.weight)
    return head
