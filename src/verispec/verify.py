"""Verification: logits -> probabilities, and the lossless acceptance rule for a chain of drafts.

Glossary (per request, one step):
- draft tokens   d_1..d_k proposed by the drafter, with draft probabilities q_i (or none: one-hot q);
- target probs   p_0..p_k from ONE target forward over [last token, d_1..d_k]; p_i is the target's
                 distribution for the token after d_i (p_0: after the last committed token);
- accepted       the longest prefix d_1..d_n that passes the test (greedy: d_i == argmax p_{i-1};
                 sampled: u_i < p_{i-1}(d_i) / q_i(d_i), u_i ~ U(0, 1));
- recovered      on the first rejection, a token drawn from norm(max(0, p - q)) (the residual),
                 which makes the emitted token distributed exactly as p;
- bonus          when all k drafts are accepted, one more token drawn from p_k.
Each step emits accepted + 1 tokens. Temperature, top-k and top-p are applied identically to the
target and the draft logits (`probs`), so both p and q are the processed distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits [N, V] fp32 -> processed probabilities [N, V] (temperature, then top-k, then top-p).
    Greedy (temperature 0) is the one-hot distribution on the argmax."""
    if sp.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
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
    rises only at them."""
    c = p.double().cumsum(0)
    u = torch.rand((), generator=gen, dtype=torch.float64, device=p.device) * c[-1]
    i = int(torch.searchsorted(c, u, right=True))
    return i if i < p.shape[0] else int(p.nonzero()[-1])  # u * total rounded up to the total


@dataclass
class Verdict:
    tokens: list[int]  # emitted this step: accepted drafts, then the recovered or bonus token
    accepted: int  # number of draft tokens accepted


def accept_greedy(target_argmax: list[int], draft: list[int]) -> Verdict:
    """target_argmax: argmax of p_0..p_k (k + 1 ints); draft: d_1..d_k."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return Verdict(draft[:n] + [target_argmax[n]], n)


def accept_sampled(
    p: torch.Tensor,  # [k + 1, V] processed target probabilities
    draft: list[int],  # k draft tokens
    q: torch.Tensor | None,  # [k, V] processed draft probabilities; None = one-hot (deterministic drafter)
    gen: torch.Generator,
) -> Verdict:
    k = len(draft)
    if k:
        idx = torch.arange(k, device=p.device)
        d = torch.tensor(draft, device=p.device)
        p_d = p[idx, d]  # [k]
        q_d = q[idx, d] if q is not None else torch.ones_like(p_d)
        u = torch.rand(k, generator=gen, device=p.device)
        ok = (u * q_d < p_d).tolist()  # u < p/q without dividing by zero
        n = ok.index(False) if False in ok else k
    else:
        n = 0
    if n == k:
        return Verdict(draft + [sample(p[k], gen)], k)
    if q is None:
        residual = p[n].clone()
        residual[draft[n]] = 0.0
    else:
        residual = (p[n] - q[n]).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q on the support: the rejection had probability 0; fall back to p
        residual = p[n]
    return Verdict(draft[:n] + [sample(residual, gen)], n)
