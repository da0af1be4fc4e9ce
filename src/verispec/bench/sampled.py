"""The sampled half of the output check: on a subsample of the benchmark's prompts, each method's
sampled output is distributed as the target's (`verispec.distcheck`, the same check as the
engine's tests, here on the real target and real prompts).

For each chosen prompt, the exact distribution of the first `SETTINGS.max_tokens` output tokens
under `SETTINGS` (temperature 0.8, top-k 5, top-p 0.95: at most 125 outcomes, and every draft
position is exercised because k >= 2) is enumerated with the target; then `n` seeded requests per
method go through the engine with the method's drafter, and the empirical distribution is
compared with the exact one. Plain decoding is checked too: it is the control that the
enumeration and the engine agree.

In bf16 the enumeration reproduces the engine's logits bit for bit. In fp32 (not batch-invariant
outside exact mode) prompts whose top-k or top-p boundary is within rounding noise of flipping are
skipped, with the reason recorded: there the support itself would depend on one forward's rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..distcheck import ExactDistribution, check_samples, exact_distribution
from ..prompts import Prompt
from ..sampling import SamplingParams
from .runner import build_engine, engine_config, parse_method_spec

SETTINGS = SamplingParams(max_tokens=3, temperature=0.8, top_k=5, top_p=0.95, ignore_eos=True)
MAX_BATCH = 64


def pick_prompts(prompts: list[Prompt], count: int) -> list[Prompt]:
    """Candidates in the order they are tried: evenly spaced over the run's prompts, then the rest."""
    if count <= 0:
        return []
    step = max(1, len(prompts) // count)
    first = prompts[::step]
    return first + [p for p in prompts if p not in first]


def run_sampled_check(target, tokenizer, model: str, drafters: list[str], k: int, dtype: str, prompts: list[Prompt],
                      num_prompts: int, n: int, max_model_len: int, factories: dict | None = None,
                      settings: SamplingParams = SETTINGS, seed: int = 0,
                      progress: Callable[[str], None] | None = None, tag: str = "") -> dict:
    """{"settings", "samples_per_check", "checks": [...], "skipped": [...]}; one check per (prompt, method);
    tag: appended to the method names (the target's precision, " [int8]")."""
    chosen: list[tuple[Prompt, ExactDistribution]] = []
    skipped = []
    for p in pick_prompts(prompts, num_prompts):
        if len(chosen) == num_prompts:
            break
        exact = exact_distribution(target, p.ids, settings, settings.max_tokens)
        if exact.borderline:
            skipped.append({"prompt": p.id, "reason": exact.borderline})
        else:
            chosen.append((p, exact))
    checks = []
    for spec in [None, *drafters]:
        drafter, tree, kk, policy = parse_method_spec(spec, k) if spec else (None, "chain", k, "fixed")
        cfg = dataclasses.replace(engine_config(model, drafter, kk, dtype, False, min(n, MAX_BATCH), max_model_len,
                                                str(target.device), tree, policy),
                                  prefill_chunk=4096)
        eng = build_engine(target, tokenizer, cfg, (factories or {}).get(drafter))
        for p, exact in chosen:
            seqs = [eng.add_request(p.ids, dataclasses.replace(settings, seed=seed + i)) for i in range(n)]
            while eng.has_work:
                eng.step()
            res = check_samples([s.output_ids for s in seqs], exact)
            drafted = sum(s.stats.drafted for s in seqs)
            accepted = sum(s.stats.accepted for s in seqs)
            checks.append({"method": (spec or "plain") + tag, "prompt": p.id, "dataset": p.dataset, **res.to_dict(),
                           "drafted": drafted, "acceptance_rate": accepted / drafted if drafted else None})
            if progress:
                progress(f"sampled check {spec or 'plain'} on {p.id}: TV {res.tv:.3f} (threshold "
                         f"{res.null.threshold:.3f}) {'ok' if res.passed else 'FAILED'}")
        del eng
    return {"settings": {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
                         if f.name in ("max_tokens", "temperature", "top_k", "top_p")},
            "samples_per_check": n, "checks": checks, "skipped": skipped}
