"""Benchmark metrics: one `Trace` per timed request, and pure functions from traces to numbers.

Every number in a report is computed here from raw traces (wall times, token ids, acceptance
counters); nothing is cached between runs. The definitions are printed with every report.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from ..sequence import SpecStats

DEFINITIONS = {
    "tau": "tokens emitted per target forward after prefill, bonus token included "
           "(= 1 + accepted/steps when every step drafts; 1.00 for plain decoding)",
    "acceptance_rate": "accepted draft tokens / draft tokens verified",
    "acceptance_unconditional[k]": "accepted at draft position k / steps that verified a draft (vLLM's definition)",
    "acceptance_conditional[k]": "accepted at draft position k / steps whose draft reached position k with every "
                                 "earlier position accepted (EAGLE's alpha_k)",
    "tokens_per_s": "output tokens / wall time, prefill included; for a set of requests: total output tokens / "
                    "total wall time of one round (single stream, one request at a time)",
    "tpot_ms": "time per output token: (request time - time to first token) / (output tokens - tokens available "
               "at the first token)",
    "ttft_ms": "time to first token: from submitting the request until its first output token is available to the "
               "caller (verispec: end of the first engine step, which runs prefill and one decode step; "
               "transformers: the streamer's first generated token; llama.cpp: the first yielded token)",
    "speedup": "paired: tokens/s of the method / tokens/s of the same target's plain decoding in the same engine, "
               "same run, same prompts, interleaved per prompt with the order rotated; per round the ratio of the "
               "round totals; reported as median [min, max] over rounds; per-prompt speed-up: the median over "
               "rounds of each prompt's ratio, then median [min, max] over prompts",
    "identical": "greedy: output token ids equal the plain decoding's token for token (same engine, same round)",
    "throughput_tok_s": "load sweep: concurrency x output tokens / summed time from admission to finish of the "
                        "max(prompts, concurrency) requests after a first wave of concurrency, with concurrency "
                        "more queued behind them so that every slot stays busy while they run (Little's law); "
                        "distinct prompts; Engine with max_batch_size = concurrency, every method's steps "
                        "alternating and each timed on its own clock, or that many streams in flight to the server",
    "drain_throughput_tok_s": "load sweep: all output tokens / time until the last request finished (the "
                              "drain included, where the batch shrinks to the slowest requests)",
    "per_user_tok_s": "load sweep: median over requests of 1 / TPOT (decode speed one user sees)",
}


@dataclass
class Trace:
    """One timed request."""

    method: str
    prompt: str  # Prompt.id
    dataset: str
    category: str
    round: int
    prompt_tokens: int
    output_ids: list[int]
    seconds: float  # submit -> last token
    ttft: float  # submit -> first output token available
    first_tokens: int  # output tokens available at ttft
    forwards: int | None = None  # target forwards after prefill (None: unknown)
    spec: dict | None = None  # SpecStats fields (verispec methods)
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tpot(self) -> float | None:
        n = self.num_tokens - self.first_tokens
        return (self.seconds - self.ttft) / n if n > 0 else None

    def stats(self) -> SpecStats | None:
        return SpecStats(**self.spec) if self.spec is not None else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, tpot_s=self.tpot)
        return d


def spec_fields(stats: SpecStats) -> dict:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in asdict(stats).items()}


def spread(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def round_rate(traces: list[Trace]) -> float:
    """Total output tokens / total wall time."""
    s = sum(t.seconds for t in traces)
    return sum(t.num_tokens for t in traces) / s if s > 0 else 0.0


def by_round(traces: list[Trace]) -> dict[int, list[Trace]]:
    out = defaultdict(list)
    for t in traces:
        out[t.round].append(t)
    return dict(sorted(out.items()))


def merged_stats(traces: list[Trace]) -> SpecStats | None:
    total = None
    for t in traces:
        s = t.stats()
        if s is not None:
            total = total or SpecStats()
            total.merge(s)
    return total


def tau(traces: list[Trace]) -> float | None:
    """Tokens per target forward after prefill; from SpecStats, or from counted forwards (peers)."""
    st = merged_stats(traces)
    if st is not None:
        return st.tau
    if any(t.forwards is None for t in traces) or not traces:
        return None
    fwd = sum(t.forwards for t in traces)
    emitted = sum(t.num_tokens - 1 for t in traces)  # the prefill forward emits the first token
    return emitted / fwd if fwd else None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def equality(traces: list[Trace], reference: list[Trace]) -> dict:
    """Each trace vs the reference trace of the same prompt and round: identical token ids?"""
    ref = {(r.prompt, r.round): r.output_ids for r in reference}
    pairs = [(t, ref[(t.prompt, t.round)]) for t in traces if (t.prompt, t.round) in ref]
    div = [first_divergence(t.output_ids, r) for t, r in pairs]
    bad = [d for d in div if d is not None]
    return {
        "identical": len(div) - len(bad), "total": len(div),
        "mismatched_prompts": sorted({t.prompt for (t, _), d in zip(pairs, div) if d is not None}),
        "first_divergence": spread(bad),
    }


def speedups(traces: list[Trace], baseline: list[Trace]) -> dict:
    """Paired speed-up of traces over baseline: per round (ratio of round totals) and per prompt."""
    base = {(b.prompt, b.round): b for b in baseline}
    rounds, per_prompt = [], defaultdict(list)
    for r, ts in by_round(traces).items():
        pairs = [(t, base[(t.prompt, r)]) for t in ts if (t.prompt, r) in base]
        if not pairs:
            continue
        b_rate = round_rate([b for _, b in pairs])
        if b_rate > 0:
            rounds.append(round_rate([t for t, _ in pairs]) / b_rate)
        for t, b in pairs:
            if b.tokens_per_s > 0:
                per_prompt[t.prompt].append(t.tokens_per_s / b.tokens_per_s)
    prompt_medians = [statistics.median(v) for v in per_prompt.values()]
    return {"rounds": rounds, "round": spread(rounds), "per_prompt": spread(prompt_medians),
            "per_prompt_values": {k: statistics.median(v) for k, v in per_prompt.items()}}


def summarize(traces: list[Trace], baseline: list[Trace] | None, compare_outputs: bool = True) -> dict:
    """Every metric of one method over a set of traces (one dataset, category or all); sampled runs
    (compare_outputs False) have no output equality to report: their check is the distribution test."""
    rates = [round_rate(ts) for ts in by_round(traces).values()]
    tpot = [t.tpot for t in traces]
    st = merged_stats(traces)
    out = {
        "requests": len(traces), "prompts": len({t.prompt for t in traces}), "rounds": len(rates),
        "output_tokens": sum(t.num_tokens for t in traces),
        "tokens_per_s": spread(rates),
        "tpot_ms": spread([x * 1e3 for x in tpot if x is not None]),
        "ttft_ms": spread([t.ttft * 1e3 for t in traces]),
        "tau": tau(traces),
    }
    if st is not None:
        out.update(acceptance_rate=st.acceptance_rate, drafted=st.drafted, accepted=st.accepted,
                   steps_with_draft=st.drafts, target_forwards=st.forwards,
                   acceptance_unconditional=st.acceptance_unconditional,
                   acceptance_conditional=st.acceptance_conditional)
    if baseline is not None:
        sp = speedups(traces, baseline)
        out["speedup"] = sp["round"]
        out["speedup_rounds"] = sp["rounds"]
        out["speedup_per_prompt"] = sp["per_prompt"]
        if compare_outputs:
            out["equality"] = equality(traces, baseline)
    return out
