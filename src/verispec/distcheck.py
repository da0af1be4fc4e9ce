"""The statistical check that sampling with speculation is distributed exactly as the target's sampling.

Sampled output cannot be compared token for token, so we compare distributions. For a prompt and
sampling settings whose filters bound the support (top-k, top-p), the exact distribution of the
first M output tokens is a product of target conditionals, and we enumerate it: one batched
target forward per position over every prefix with non-zero probability (`exact_distribution`).
N requests, each with its own seed, are then sampled through the engine; the total variation (TV)
between their empirical distribution and the exact one is compared with the null, the TV of N
samples drawn from the exact distribution itself (`null_tvs`): the check passes below the largest
of `reps` null TVs plus two null standard deviations (about five standard deviations above the
null mean for the sizes we use). A biased acceptance rule moves TV far above that (the engine's
tests show one at 0.27 against a 0.10 threshold).

Used by the engine's tests (tiny models, every drafter) and by `verispec bench` on a subsample of
real prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv import KV_BLOCK, round_up
from .sampling import SamplingParams, probs


@dataclass
class ExactDistribution:
    outcomes: list[tuple[int, ...]]  # every output token sequence with non-zero probability
    probs: torch.Tensor  # [O] float64, sums to 1
    borderline: str | None  # why a filter decision may flip under rounding noise; None when safe

    def index(self) -> dict[tuple[int, ...], int]:
        return {o: i for i, o in enumerate(self.outcomes)}


@torch.inference_mode()
def exact_distribution(target, prompt_ids: list[int], sp: SamplingParams, num_tokens: int, exact: bool = False,
                       max_outcomes: int = 4096, logit_margin: float = 1e-3, p_margin: float = 1e-4,
                       batch: int = 64) -> ExactDistribution:
    """The exact distribution of the first `num_tokens` tokens the engine's plain decoding of
    `target` samples after `prompt_ids`, computed with the engine's own numerics.

    `exact` is the engine's exact mode. Token 1 comes from a prefill, tokens 2.. from decode
    forwards. Where the engine's forwards are batch-invariant (its default in bf16/fp16, and exact
    mode: `Engine.invariant`) a row's bits depend neither on the batch, nor on the verify
    window, nor on the prefill chunking, so one prefill and one batched forward per position over
    every prefix reproduce the engine's logits bit for bit. Every conditional is processed by
    `verify.probs` as the engine processes it.

    Without invariance (fp32 outside exact mode) the logits agree only to rounding, so `borderline`
    is set when a top-k or top-p boundary lies within `logit_margin` (logits) or `p_margin`
    (cumulative probability) of flipping: the support would then depend on one forward's rounding,
    and the check would test numerics, not the sampler.
    """
    P = len(prompt_ids)
    invariant = exact or target.dtype != torch.float32  # Engine.invariant: prefill and decode
    was = target.invariant
    target.set_batch_invariant(invariant)
    try:
        cache = target.new_cache(1 + batch, round_up(P + num_tokens, KV_BLOCK))  # slot 0: the prompt
        out = target(torch.tensor([list(prompt_ids)], device=target.device), cache, [0], torch.zeros(1, dtype=torch.long),
                     logit_rows=torch.tensor([[P - 1]]), kv_len=round_up(P, KV_BLOCK) if invariant else None)
        cache.commit(0, P)
        logits = out.logits[:, 0].float().cpu()  # [1, V]
        prefixes: list[tuple[int, ...]] = [()]
        weights = torch.ones(1, dtype=torch.float64)
        borderline = None
        for t in range(num_tokens):
            if t:
                logits = torch.cat([_next_logits(target, cache, P, prefixes[i : i + batch], invariant)
                                    for i in range(0, len(prefixes), batch)])  # [n, V] fp32
                if not invariant:
                    borderline = borderline or _borderline(logits, sp, logit_margin, p_margin, t)
            p = probs(logits, sp).double()  # [n, V]
            rows, toks = p.nonzero(as_tuple=True)
            if len(rows) > max_outcomes:
                raise ValueError(f"the sampling settings allow {len(rows)} outcomes at output token {t + 1} "
                                 f"(limit {max_outcomes}); use a smaller top_k / top_p or fewer tokens")
            weights = weights[rows] * p[rows, toks]
            prefixes = [prefixes[r] + (k,) for r, k in zip(rows.tolist(), toks.tolist())]
    finally:
        target.set_batch_invariant(was)
    return ExactDistribution(prefixes, weights / weights.sum(), borderline)


def _next_logits(target, cache, P: int, prefixes: list[tuple[int, ...]], invariant: bool) -> torch.Tensor:
    """Decode forward of each prefix (all of length t) after the prompt held in slot 0 -> the
    next-token logits [n, V], as the engine's verify forward computes them."""
    n, t = len(prefixes), len(prefixes[0])
    slots = list(range(1, n + 1))
    for s in slots:
        cache.rollback(s, 0)
        cache.share_prefix(0, s, P)
    ids = torch.tensor(prefixes, device=target.device)  # [n, t]
    out = target(ids, cache, slots, torch.full((n,), P, dtype=torch.long),
                 logit_rows=torch.full((n, 1), t - 1, dtype=torch.long),
                 kv_len=round_up(P + t, KV_BLOCK) if invariant else None)
    return out.logits[:, 0].float().cpu()


def _borderline(logits: torch.Tensor, sp: SamplingParams, logit_margin: float, p_margin: float, t: int) -> str | None:
    if sp.greedy:
        top2 = logits.topk(2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        return f"output token {t + 1}: the top two logits are {gap:.3g} apart" if gap < logit_margin else None
    x = logits / sp.temperature
    if sp.top_k is not None and sp.top_k < x.shape[-1]:
        s = x.topk(sp.top_k + 1, dim=-1).values
        gap = float((s[:, -2] - s[:, -1]).min())
        if gap < logit_margin / sp.temperature:
            return f"output token {t + 1}: top-k boundary logits are {gap * sp.temperature:.3g} apart"
        x = x.masked_fill(x < s[:, -2:-1], float("-inf"))
    if sp.top_p < 1:
        ps = x.softmax(-1).sort(-1, descending=True).values
        before = ps.cumsum(-1) - ps
        live = ps > 0
        gap = float((before - sp.top_p).abs()[live].min())
        if gap < p_margin:
            return f"output token {t + 1}: a top-p boundary is {gap:.3g} from top_p"
    return None


def tv(counts: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Total variation between empirical counts [..., O] and the exact distribution [O]."""
    counts = counts.double()
    return 0.5 * (counts / counts.sum(-1, keepdim=True) - exact).abs().sum(-1)


def null_counts(exact: torch.Tensor, n: int, reps: int = 200, seed: int = 12345) -> torch.Tensor:
    """[reps, O] counts of `reps` independent sets of n samples drawn from `exact` itself."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(exact, n * reps, replacement=True, generator=g).view(reps, n)
    return torch.zeros(reps, exact.numel(), dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(reps, n, dtype=torch.float64))


@dataclass
class NullTV:
    mean: float
    max: float
    threshold: float  # max + 2 standard deviations

    @classmethod
    def of(cls, tvs: torch.Tensor) -> "NullTV":
        return cls(tvs.mean().item(), tvs.max().item(), tvs.max().item() + 2 * tvs.std().item())


def null_tv(exact: torch.Tensor, n: int, reps: int = 200, seed: int = 12345) -> NullTV:
    return NullTV.of(tv(null_counts(exact, n, reps, seed), exact))


@dataclass
class CheckResult:
    samples: int
    outcomes: int  # outcomes with non-zero exact probability
    tv: float
    null: NullTV
    outside_support: int  # samples the exact distribution gives probability 0

    @property
    def passed(self) -> bool:
        return self.outside_support == 0 and self.tv <= self.null.threshold

    def to_dict(self) -> dict:
        return {"samples": self.samples, "outcomes": self.outcomes, "tv": self.tv, "null_tv_mean": self.null.mean,
                "null_tv_max": self.null.max, "threshold": self.null.threshold,
                "outside_support": self.outside_support, "passed": self.passed}


def check_samples(outputs: list[list[int]], exact: ExactDistribution, reps: int = 200) -> CheckResult:
    """Compare sampled outputs (each at least as long as the enumerated outcomes) with `exact`."""
    m = len(exact.outcomes[0])
    index = exact.index()
    counts = torch.zeros(len(exact.outcomes) + 1, dtype=torch.float64)  # last bin: outside the support
    for out in outputs:
        counts[index.get(tuple(out[:m]), len(exact.outcomes))] += 1
    outside = int(counts[-1])
    full = torch.cat([exact.probs, torch.zeros(1, dtype=torch.float64)])
    return CheckResult(len(outputs), len(exact.outcomes), tv(counts, full).item(), null_tv(exact.probs, len(outputs), reps),
                       outside)
