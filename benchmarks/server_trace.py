"""The adaptive policy's per-step trace through the HTTP server (plan_trace.py's records, served).

The server sweep runs one long-lived `verispec serve` per method through every level, so the
adaptive policy at 64 streams arrives warm from 1 to 32, and its steps share the machine with the
event loop (HTTP, text, SSE) and the client. This serves a plain and an adaptive engine in threads
of this process (profile_server.py's `Served`), streams each level's sweep requests to them from a
client process (levels in order, methods alternating), and prints per level the tok/s of both, tau,
and the adaptive engine's steps: how many verified nothing, probes, plans and how they ran against
the median plain-like step.

    PYTHONPATH=src python benchmarks/server_trace.py --levels 16,32,64 [--json steps.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from verispec.threads import choose_wait_policy

USER_WAITS = "OMP_WAIT_POLICY" in os.environ
CHOSEN = choose_wait_policy()  # as `verispec serve` chooses, before torch is loaded
from profile_server import Served, run_client  # noqa: E402 (it defaults to passive waits)

if not USER_WAITS and CHOSEN is None:
    os.environ.pop("OMP_WAIT_POLICY", None)

import torch  # noqa: E402

from load_split import level_requests  # noqa: E402
from plan_trace import trace_policy  # noqa: E402


def summary(steps: list[dict], n: int) -> str:
    full = [s for s in steps if s["n"] >= 3 * n // 4]
    if not full:
        return "no full-batch steps"
    idle = [s["verify_s"] + s["draft_s"] for s in full if not s["admitted"]]
    plain_like = statistics.median(idle) if idle else float("nan")
    planned = [s for s in full if s["admitted"] and not s["probe"]]
    probes = [s for s in full if s["probe"]]
    ran = [(s["n"] + s["accepted"]) / (s["verify_s"] + s["draft_s"]) / (s["n"] / plain_like) for s in planned]
    pr = [(s["n"] + s["accepted"]) / (s["verify_s"] + s["draft_s"]) / (s["n"] / plain_like) for s in probes]
    return (f"{len(full)} steps at >= 3/4 batch: {len(idle)} verified nothing (median {plain_like * 1e3:.1f} ms, "
            f"drafting {statistics.mean(s['draft_s'] for s in full) * 1e3:.2f} ms a step); {len(planned)} plans "
            f"(admitted {sum(s['admitted'] for s in planned)}, accepted {sum(s['accepted'] for s in planned)}, "
            f"ran at {statistics.median(ran) if ran else float('nan'):.2f}x plain-like, predicted "
            f"{statistics.median(s['predicted_ratio'] for s in planned) if planned else float('nan'):.2f}x); "
            f"{len(probes)} probes (ran at {statistics.median(pr) if pr else float('nan'):.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="16,32,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the adaptive policy's step records per level here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from verispec.engine import LLM

    levels = [int(c) for c in args.levels.split(",")]
    slots = max(levels)
    llms = {name: LLM("gemma3-270m", drafter=drafter, num_draft_tokens=k, draft_policy=policy, dtype="bfloat16",
                      max_batch_size=slots, max_model_len=512, prefill_chunk=256)
            for name, (drafter, k, policy) in {"plain": (None, 0, "fixed"), "adaptive": ("ngram", 7, "adaptive")}.items()}
    served = {name: Served(name, llm, False) for name, llm in llms.items()}
    steps = trace_policy(llms["adaptive"].engine.policy)
    for s in served.values():
        run_client(s.server.url, [[2, 106, 1645]] * 2, 2, 4)  # warm-up, untimed
    records = {}
    for i, n in enumerate(levels):
        _, _, reqs, _ = level_requests(n, 140)
        ids = [p.ids for p in reqs]
        out, timing = {}, {}
        for name in (["plain", "adaptive"] if i % 2 == 0 else ["adaptive", "plain"]):
            steps.clear()
            served[name].timer.reset()
            res = run_client(served[name].server.url, ids, n, args.max_tokens)
            out[name] = res["tokens"] / res["seconds"]
            st = served[name].timer.summary()
            full = sorted(r[0] for r in served[name].timer.rows if r[1] == n and r[2] == 0)
            timing[name] = (f"{name}: {st['steps']} steps, {st['decode_steps']} without prompts (mean "
                            f"{st['decode_ms']:.1f} ms, batch {st['decode_batch']:.1f}; at the full batch "
                            f"{len(full)}, median {1e3 * full[len(full) // 2] if full else float('nan'):.1f} ms), "
                            f"engine thread between steps {st['gap_ms']:.2f} ms")
            if name == "adaptive":
                records.setdefault(n, []).append(list(steps))
        steps[:] = records[n][-1]
        print(f"{n} streams: plain {out['plain']:.1f} tok/s, adaptive {out['adaptive']:.1f} "
              f"({out['adaptive'] / out['plain']:.3f}x); adaptive: {summary(steps, n)}\n  " + "\n  ".join(timing.values()),
              flush=True)
    for s in served.values():
        s.server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f)


if __name__ == "__main__":
    main()
