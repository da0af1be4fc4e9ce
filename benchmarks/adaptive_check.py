"""Reads a `verispec bench` report with a load sweep and says, per concurrency and path (in process,
server), whether the adaptive policy reached max(plain, best fixed k) - 3% in throughput; beside it
the same ratio by the drain (every token of the level over its time, on each method's own clock
in process): one round of the measured wave's lives moved 5-8% against the level's time where
the policy ran plain decoding's schedule (BENCHMARKS.md, session 35).

    python benchmarks/adaptive_check.py benchmarks/results/adaptive/report.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> int:
    sweep = json.load(open(path))["sweep"]
    points = defaultdict(dict)  # (via, concurrency) -> method -> tok/s
    drains = defaultdict(dict)  # the same, with the drain
    for p in sweep:
        via = "server" if p["method"].endswith("(server)") else "engine"
        name = p["method"].removesuffix(" (server)")
        points[(via, p["concurrency"])][name] = p["throughput_tok_s"]
        drains[(via, p["concurrency"])][name] = p.get("drain_throughput_tok_s")
    rows, ok_all = [], True
    for (via, c), m in sorted(points.items()):
        adaptive = next((k for k in m if "policy=" not in k and k != "plain"), None)
        baselines = [k for k in m if k == "plain" or "policy=fixed" in k]
        if adaptive is None or "plain" not in m:  # (a run without fixed k compares with plain decoding alone)
            continue
        best_name, best = max(((k, m[k]) for k in baselines), key=lambda x: x[1])
        a = m[adaptive]
        ok = a >= 0.97 * best
        ok_all &= ok
        d = drains[(via, c)]
        by_drain = f"{d[adaptive] / max(d[k] for k in baselines):.3f}" if all(d.get(k) for k in m) else "–"
        rows.append(f"| {via} | {c} | {m['plain']:.1f} | {best_name} {best:.1f} | {a:.1f} | {a / best:.3f} | "
                    f"{a / m['plain']:.2f}x | {'yes' if ok else 'NO'} | {by_drain} |")
    print("| path | concurrency | plain tok/s | best of plain and fixed k | adaptive tok/s | adaptive / best | "
          "adaptive / plain | within 3% | adaptive / best, with the drain |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
