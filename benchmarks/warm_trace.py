"""The adaptive policy at 64 streams after it served 16 and 32 (as the sweep's and a server's
policy does), beside plain decoding, twice in rotated order: throughput after the first wave, the
wall time, and where the steps went (full-batch decode steps, steps with prompt chunks), with
server_trace.py's summary of the policy's steps.

Session 24 (benchmarks/results/adaptive-s24b/warm64_trace.txt): adaptive 0.92-0.94x plain by the
sweep's measure, in 19.6-19.8 s of wall time against 19.2; its staggered finishes put prompt
chunks in 96 steps (11.7 s) where plain decoding's waves put them in 63 (8.1 s), while its plans
ran 1.35-1.46x a plain-like step.

    PYTHONPATH=src:benchmarks python benchmarks/warm_trace.py
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")  # run from the repository root
from load_split import level_requests, timed_engine
from plan_trace import trace_policy
from server_trace import summary
from verispec.bench.runner import busy_throughput, run_batch
torch.set_num_threads(2)
policy = None
for n in (16, 32, 64):
    tok, target, reqs, measured = level_requests(n, 140)
    ad = timed_engine(target, tok, "adaptive", "ngram", 7, n)
    if policy is None:
        policy = ad.policy; steps = trace_policy(policy)
    else:
        ad.policy = policy
    engs = {"adaptive": ad} if n < 64 else {"plain": timed_engine(target, tok, "fixed", None, 0, n), "adaptive": ad}
    for rnd in range(1 if n < 64 else 2):
        for name, eng in (engs.items() if rnd == 0 else reversed(engs.items())):
            run_batch(eng, reqs[:n], 4); eng.steps_log.clear(); steps.clear()
            t = time.perf_counter()
            _, rows, st = run_batch(eng, reqs, 64)
            wall = time.perf_counter() - t
            dec = [x for x in eng.steps_log if x[0] == "decode" and x[2] == n]
            mixed = [x for x in eng.steps_log if x[0] != "decode"]
            print(f"{n} r{rnd} {name}: {busy_throughput(rows, n, measured):.1f} tok/s tau {st.tau:.2f} wall {wall:.1f}s; full decode steps {len(dec)} median {statistics.median(x[1] for x in dec)*1e3:.1f} ms sum {sum(x[1] for x in dec):.1f}s; prefill/mixed steps {len(mixed)} sum {sum(x[1] for x in mixed):.1f}s; all steps {len(eng.steps_log)}", flush=True)
            if name == "adaptive" and n == 64:
                print("   ", summary(steps, n))
