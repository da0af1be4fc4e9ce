"""Sampling in one place: a request's parameters, logits -> processed probabilities, one draw.

Greedy decoding is the one-hot case of `probs` (the only place that tells greedy from sampled):
the verifiers and drafters treat every request as sampling from a distribution, and a point mass
always yields its argmax. Temperature, top-k and top-p are applied identically to the target and
the draft logits, so both p and q are the processed distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 means greedy (argmax)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None  # None: no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; n >= 0: the chosen token's logprob and the top n

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and self.temperature != float("inf")):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1): the first largest entry of each row, a NaN counted largest. fp32
    or bf16 rows [N, V] on a CPU take kernels/argmax.c (torch's CPU argmax is a scalar loop: 0.34
    ms for one of Gemma's 262,144-entry rows, 3% of an int8 decode step), with the same answers."""
    if logits.dim() == 2 and logits.device.type == "cpu":
        fn = {torch.float32: kernels.argmax_f32, torch.bfloat16: kernels.argmax_bf16}.get(logits.dtype, lambda: None)()
        if fn is not None:
            return kernels.run_argmax(fn, logits)
    return logits.argmax(-1)


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits [N, V] fp32 -> processed probabilities [N, V] (temperature, then top-k, then top-p).
    Greedy (temperature 0) is the one-hot distribution on the argmax."""
    if sp.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax(logits)[..., None], 1.0)
    logits = logits / sp.temperature
    if sp.top_k is not None and sp.top_k < logits.shape[-1]:
        kth = logits.topk(sp.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = logits.softmax(-1)
    if sp.top_p < 1.0:
        p = _top_p(p, sp.top_p)
    return p


def _top_p(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop a token when the tokens ranked before it already cover top_p; renormalize.

    Sorting a 262k vocabulary per row costs more than a small model's forward, so the ranking is
    taken over the few most likely tokens when they provably hold every kept one (the running
    total before the last candidate reaches top_p); the full sort is the fallback."""
    V = p.shape[-1]
    m = min(V, 64)
    while True:
        sorted_p, order = p.topk(m, dim=-1)  # [N, m], descending
        before = sorted_p.cumsum(-1) - sorted_p
        if m == V or bool((before[:, -1] >= top_p).all()):
            break
        m = min(V, m * 16)
    drop_sorted = before >= top_p
    keep = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, ~drop_sorted)
    p = p.masked_fill(~keep, 0.0)
    return p / p.sum(-1, keepdim=True)


def sample(p: torch.Tensor, gen: torch.Generator) -> int:
    """One token from probabilities p [V] (need not sum to 1), drawn with the request's generator:
    the inverse of the running total at one uniform draw (a multinomial over a 262k vocabulary
    costs more than a small model's forward). Only tokens with p > 0 can be drawn: the total
    rises only at them. A point mass (greedy) is its argmax, with no draw."""
    if int(torch.count_nonzero(p)) == 1:
        return int(p.argmax())
    c = p.double().cumsum(0)
    u = torch.rand((), generator=gen, dtype=torch.float64, device=p.device) * c[-1]
    i = int(torch.searchsorted(c, u, right=True))
    return i if i < p.shape[0] else int(p.nonzero()[-1])  # u * total rounded up to the total
