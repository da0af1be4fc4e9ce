"""What a verified draft node really costs at a full batch, from a step trace, against what the
adaptive policy priced it at and what a plain decode token costs.

Full-batch decode steps without prompt chunks (n >= level - 1), from a trace written by
`PYTHONPATH=benchmarks/step_trace VERISPEC_STEP_TRACE=DIR python benchmarks/level_steps.py ...`:
a least-squares fit of the step's time after drafting, s = base + per_node * B + any_plan * [B > 0]
(B the verified nodes), the same steps grouped by B, and the median priced cost of a node
((cost_plan - cost_plain) / B). A node pays where per_node / acceptance < base / n.

    python benchmarks/node_cost.py TRACE.json[.gz] 64
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys

import numpy as np


def main() -> None:
    path, level = sys.argv[1], int(sys.argv[2])
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        data = json.load(f)
    recs = data["records"] if isinstance(data, dict) else data
    steps = [r for r in recs if r["kind"] == "decode" and r["n"] >= level - 1 and not r["prompt"] and "drafted" in r]
    B = np.array([r.get("admitted", 0) for r in steps], float)
    s = np.array([r["s"] - r.get("draft_s", 0.0) for r in steps])
    X = np.stack([np.ones_like(B), B, (B > 0).astype(float)], 1)
    base, per_node, any_plan = np.linalg.lstsq(X, s, rcond=None)[0]
    acc = sum(r.get("accepted", 0) for r in steps) / max(1.0, B.sum())
    print(f"{len(steps)} full-batch steps without prompt chunks at {level} streams; acceptance of verified nodes {acc:.2f}")
    print(f"fit: base {base * 1e3:.1f} ms ({base / level * 1e3:.2f} ms a decode token), per node {per_node * 1e3:.2f} ms, "
          f"any plan {any_plan * 1e3:.1f} ms; a node pays if {per_node * 1e3:.2f} / acceptance < {base / level * 1e3:.2f}")
    for lo, hi in ((0, 0), (1, 10), (11, 30), (31, 10_000)):
        sel = [(b, t, r) for b, t, r in zip(B, s, steps) if lo <= b <= hi]
        if not sel:
            continue
        priced = [(r["cost_plan"] - r["cost_plain"]) / b for b, _, r in sel if b and r.get("cost_plan") is not None]
        print(f"  B {lo}-{hi}: {len(sel)} steps, B med {statistics.median(b for b, _, _ in sel):.0f}, "
              f"step med {statistics.median(t for _, t, _ in sel) * 1e3:.1f} ms"
              + (f", priced {statistics.median(priced) * 1e3:.2f} ms a node" if priced else ""))


if __name__ == "__main__":
    main()
