"""Per-step trace of the adaptive policy at one load level, beside plain decoding: for every decode
step the batch size, the nodes drafted and admitted, the accepted ones, the drafting and verify
times, and the plan's predicted throughput against plain decoding's (theta of the chosen budget
over theta(0), packed chains). Then how the plans predicted 0-2%, 2-6%, ... faster than plain
decoding really ran, against the median plain-like step (nothing admitted, full batch).

It found the costs that session 19 removed at 64 streams (BENCHMARKS.md): marginal plans that
ran 4% slower than predicted, probes of a node per request, and drafting that nothing used.

    PYTHONPATH=src python benchmarks/plan_trace.py --concurrency 64 [--json steps.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import verispec.adaptive.policy as policy_module
from load_split import level_requests, timed_engine
from verispec.bench.runner import busy_throughput, run_batch


def trace_policy(policy) -> list[dict]:
    """Wrap the policy's admit and observe so that each decode step appends one record."""
    steps: list[dict] = []
    last_theta: list[float] = [0.0]
    scored = policy_module.budget_throughput

    def scoring(*a, **kw):
        last_theta[:] = scored(*a, **kw)
        return last_theta

    policy_module.budget_throughput = scoring
    admit, observe = policy.admit, policy.observe

    def traced_admit(seqs, drafts, draft_seconds):
        last_theta[:] = [0.0]
        out = admit(seqs, drafts, draft_seconds)
        chosen = last_theta[min(policy.last_admitted, len(last_theta) - 1)]
        steps.append(dict(n=len(seqs), drafted=policy.last_drafted, admitted=policy.last_admitted,
                          draft_s=draft_seconds, probe=policy._probe, predicted_gain=sum(sum(c) for c in policy._pending.values()),
                          predicted_ratio=chosen / last_theta[0] if last_theta[0] else None, t0=time.perf_counter()))
        return out

    def traced_observe(seqs, drafts, verdicts):
        steps[-1]["accepted"] = sum(v.accepted for v in verdicts)
        steps[-1]["verify_s"] = time.perf_counter() - steps[-1].pop("t0")
        return observe(seqs, drafts, verdicts)

    policy.admit, policy.observe = traced_admit, traced_observe
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the adaptive policy's step records here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    n = args.concurrency
    tok, target, reqs, measured = level_requests(n, 140)  # the sweep's cap in session 19's runs
    engines = {"plain": timed_engine(target, tok, "fixed", None, 0, n),
               "adaptive": timed_engine(target, tok, "adaptive", "ngram", 7, n)}
    steps = trace_policy(engines["adaptive"].policy)
    for name, eng in engines.items():
        run_batch(eng, reqs[:n], 4)  # warm-up
        eng.steps_log.clear()
        steps.clear()
        _, rows, stats = run_batch(eng, reqs, args.max_tokens)
        full = [x[1] for x in eng.steps_log if x[0] == "decode" and x[2] == n]
        print(f"{name}: {busy_throughput(rows, n, measured):.1f} tok/s after the first wave, tau {stats.tau:.2f}; "
              f"{len(full)} full-batch decode steps, median {statistics.median(full) * 1e3:.0f} ms", flush=True)
    full = [s for s in steps if s["n"] == n]
    plain_like = statistics.median(s["verify_s"] + s["draft_s"] for s in full if not s["admitted"])
    print(f"adaptive, full batch: {sum(not s['admitted'] for s in full)} of {len(full)} steps verified nothing "
          f"(median {plain_like * 1e3:.0f} ms), {sum(s['probe'] for s in full)} probes, drafting "
          f"{statistics.mean(s['draft_s'] for s in full) * 1e3:.1f} ms a step")
    bins = [(0.0, 1.0), (1.0, 1.02), (1.02, 1.06), (1.06, 1.3), (1.3, float("inf"))]
    planned = [s for s in steps if s["admitted"] and not s["probe"] and s["n"] >= 3 * n // 4 and s["predicted_ratio"]]
    for lo, hi in bins:
        ran = [(s["n"] + s["accepted"]) / (s["verify_s"] + s["draft_s"]) / (s["n"] / plain_like)
               for s in planned if lo <= s["predicted_ratio"] < hi]
        if ran:
            print(f"  plans predicted {lo:.2f}-{hi:.2f}x plain: {len(ran)} steps ran at {statistics.median(ran):.2f}x (median)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(steps, f)


if __name__ == "__main__":
    main()
