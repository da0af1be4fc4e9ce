"""Greedy tokens of the bf16 LM head from an int8 copy of it, exactly.

A greedy decode step needs one thing from the LM head: the first index of each row's largest
bf16 logit. On Gemma 3 270M the head is 262,144 x 640: 335 MB of bf16, more than half of what a
decode step reads. `GreedyHead` reads an int8 copy instead (168 MB, kernels/int8_gemm.c), bounds
how far each approximate logit can be from the bf16 kernel's, keeps the tokens that could still be
the largest, and computes those few with the bf16 kernel itself (kernels/bf16_gemm.c, each
output lane on its own: a row of the head gives the same bits alone as among all the others).
So the token is the one the full bf16 head gives, bit for bit, ties included; what changes is
what is read. tests/test_greedy_head.py checks it against the full head.

The bound, for an input row x and head row i (W_i bf16, int8 codes q_i with bf16 scale s_i,
e_i = W_i - s_i q_i, K = 640 columns, u = 2^-24 the fp32 unit roundoff, 2^-8 bf16's):
  y_i = bf16(F_i), F_i the bf16 kernel's fp32 sum of x_k W_ik: |F_i - x.W_i| <= g ||x|| ||W_i||
  a_i = bf16(fl(G_i s_i)), G_i the int8 kernel's fp32 sum of x_k q_ik: |G_i - x.q_i| <= g ||x|| ||q_i||
  x.W_i - s_i x.q_i = x.e_i, at most ||x|| ||e_i|| (Cauchy-Schwarz)
with g = (K + 2) u (a sum of K terms; each product is exact in fp32). With the two bf16
roundings (each at most 2^-8 of its value) this gives
  |y_i - a_i| <= 1.01 ||x|| c_i + REL |a_i| + ABS,  c_i = ||e_i|| + g (||W_i|| + s_i ||q_i||),
REL = 0.008 >= (1 + 2^-7)(2^-7 + 2^-22) and ABS a margin for the fp32 arithmetic of the test
itself. The largest a_m gives a lower bound L on the largest y; a token whose upper bound
a_i + (bound) is below L cannot be the argmax, strictly.

Where it pays: where the head is read, not computed: a few rows per call (greedy decoding at
batch 1, short verify windows). `GreedyHead.build` times both heads once per machine and
keeps the row counts where this one is faster (`max_rows`, cached).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time

import torch

from .. import kernels

REL = 0.008
ABS = 1e-3
MIN_BYTES = 32 << 20  # a smaller head is read in about the time the shortcut's own work takes
TOPK = 256  # the first cut looks among each row's top 256 approximate logits (all of them if some lie beyond)
MAX_ROWS = 8  # rows timed at build; past a few rows the int8 kernel computes more than it reads


class GreedyHead:
    """`tokens(x [M, K] bf16) -> [M]` greedy tokens of the prepacked bf16 head `full`, or None where
    the shortcut does not apply (a non-finite input)."""

    @classmethod
    @torch.inference_mode()
    def build(cls, weight: torch.Tensor, full) -> "GreedyHead | None":
        """A greedy head for the row counts where it is faster than the full head on this machine,
        or None where it pays at no row count or the kernels are missing. The rows are timed once
        per machine, head shape, thread count and kernel sources (median of 7, the two heads
        alternating, on `typical_inputs`) and cached: every process on the machine then takes the
        same path (a server's plain and speculative engines, the cost profile that prices them,
        whose cache key names the rows)."""
        if weight.numel() * weight.element_size() < MIN_BYTES:
            return None
        try:
            head = cls(weight, full)
        except ValueError:
            return None
        path = _rows_path(weight)
        try:
            head.max_rows = int(json.loads(path.read_text())["max_rows"])
        except (OSError, ValueError, KeyError, TypeError):  # not timed on this machine yet
            head.max_rows = head._time_rows()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"max_rows": head.max_rows}))
            os.replace(tmp, path)
        head.calls = head.candidates = 0
        return head if head.max_rows else None

    def _time_rows(self) -> int:
        """The most rows (up to MAX_ROWS) for which this head is faster than the full head, every
        smaller count too."""
        x = typical_inputs(self.weight, MAX_ROWS)

        def faster(m: int) -> bool:  # the two heads alternately, so that a burst of other work hits both
            times: dict = {self.tokens: [], self.full.mm: []}
            for _ in range(7):
                for fn in times:
                    t0 = time.perf_counter()
                    fn(x[:m])
                    times[fn].append(time.perf_counter() - t0)
            return statistics.median(times[self.tokens]) < statistics.median(times[self.full.mm])

        rows = 0
        while rows < MAX_ROWS and faster(rows + 1):
            rows += 1
        return rows

    def __init__(self, weight: torch.Tensor, full, max_rows: int = MAX_ROWS):
        from .quant import PackedWeight

        weight = weight.detach()
        self.weight, self.full = weight, full  # the dense bf16 head [V, K] (rows are gathered), its prepacked form
        self.int8 = PackedWeight(weight, "int8")
        self.bf16_fn = kernels.bf16_gemm()
        if self.int8.native is None or self.bf16_fn is None or full.native is None:
            raise ValueError("the greedy head needs verispec's bf16 and int8 kernels")
        V, K = weight.shape
        g = (K + 2) * 2.0 ** -24 * 1.01
        slack = torch.empty(V, dtype=torch.float64)
        codes = self.int8.codes()
        for lo in range(0, V, 16384):  # in slices: the fp64 copies of the whole head would be 1.3 GB each
            w = weight[lo : lo + 16384].double()
            sq = codes[lo : lo + 16384].double() * self.int8.scale[lo : lo + 16384].double()[:, None]
            slack[lo : lo + 16384] = (w - sq).norm(dim=1) + g * (w.norm(dim=1) + sq.norm(dim=1))
        self.slack = (slack * 1.01).float() * (1 + 2.0 ** -20)  # rounded up, as fp32
        self.slack_max = float(self.slack.max())
        self.max_rows = max_rows  # calls of up to this many rows take the shortcut (CausalLM.greedy_tokens)
        self.calls = self.candidates = 0  # rows it answered and candidates it rescored (tests, benchmarks)

    def tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        if not torch.isfinite(x).all():
            return None
        x = x.contiguous()
        a = self.int8.mm(x)  # [M, V] bf16: the approximate logits
        xn = (x.double().norm(dim=1) * (1 + 1e-9)).float() * (1 + 2.0 ** -20)  # [M], rounded up (an fp32 sum of 640 squares is off by up to ~2e-5)
        vals, idx = a.topk(min(TOPK, a.shape[1]), dim=1)  # [M, TOPK], largest first
        top, first = vals[:, 0].float(), idx[:, 0]  # [M]
        lower = top - (1.01 * xn * self.slack[first] + REL * top.abs() + ABS)  # [M]: y at `first` is at least this
        # a token is out if even its largest possible y is below `lower`: a first cut with the
        # largest slack of any row, one comparison per logit in bf16 ...
        reach = lower - 1.01 * xn * self.slack_max - 2 * ABS  # a_i (1 + REL sign(a_i)) must reach this
        cut = torch.where(reach > 0, reach / (1 + REL), reach / (1 - REL))
        cut = (cut - cut.abs() * 2.0 ** -7 - ABS).to(torch.bfloat16)  # lowered so that rounding cannot raise it past the cut
        if vals.shape[1] == a.shape[1] or bool((vals[:, -1] < cut).all()):  # every token past the cut is in the top TOPK
            rows, pos = (vals >= cut[:, None]).nonzero(as_tuple=True)
            cols = idx[rows, pos]
        else:  # a flat row: search all of it
            rows, cols = (a >= cut[:, None]).nonzero(as_tuple=True)
        # ... then each survivor with its own row's slack
        av = a[rows, cols].float()
        keep = av + 1.01 * xn[rows] * self.slack[cols] + REL * av.abs() + ABS >= lower[rows]
        rows, cols = rows[keep], cols[keep]
        union, where = torch.unique(cols, return_inverse=True)  # sorted: ties go to the smaller token
        sub = kernels.pack_bf16(self.weight[union])
        y = kernels.run_bf16_gemm(self.bf16_fn, x, sub, None, len(union)).float()  # [M, C]: the full head's bits
        scores = torch.full_like(y, -math.inf)
        scores[rows, where] = y[rows, where]
        self.calls += x.shape[0]
        self.candidates += len(cols)
        return union[scores.argmax(dim=1)]


def typical_inputs(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Inputs [rows, K] shaped like a trained model's final states for timing the greedy head:
    head rows scaled to norm 100, whose logits peak at their token (a zero or random input leaves
    most of the vocabulary within the bound, which a real state does not)."""
    g = torch.Generator().manual_seed(0)
    x = weight[torch.randint(weight.shape[0], (rows,), generator=g)].float()
    return (x * (100 / x.norm(dim=1, keepdim=True).clamp(min=1e-6))).to(weight.dtype)


def _rows_path(weight: torch.Tensor):
    """Where `GreedyHead.build` caches its timed row count for this machine and head shape."""
    from .loading import cache_root

    key = [kernels.cpu_name(), os.cpu_count(), torch.get_num_threads(), list(weight.shape), kernels.source_hash()]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return cache_root() / "greedy_head" / f"{digest}.json"
