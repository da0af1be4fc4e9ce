"""What the adaptive policy's verified plans cost per token they gained, against plain decoding's
cost per token, at each level of a traced in-process sweep (`benchmarks/step_trace`; see
`inprocess_trace.py` for how to trace one).

Plain decoding's steps at a level are fitted by least squares, seconds = a + b N + c P (N
requests, P prompt tokens riding in the forward). The policy's steps are then priced by that fit
as if they had verified nothing: a plan step's time beyond its price, over the draft tokens it
accepted, is what a gained token cost; a plan pays where that is below plain decoding's seconds
per token, (a + b N) / N. Only steps at a full batch (within an eighth of the level) are
compared, where that is one number. Steps that verified nothing are listed by their time beyond
the price too (drafting, planning, and the machine's noise). Speculation at a level can
only gain where a gained token costs less than a plain one.

    python benchmarks/plan_cost.py DIR [MIN_LEVEL]
"""

import gzip
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from inprocess_trace import levels


def load(directory: str) -> list[dict]:
    records = []
    for f in sorted(Path(directory).glob("*.json*")):
        data = json.loads(gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_text())
        records += data["records"]
    return sorted(records, key=lambda r: r["t"])


def main() -> None:
    min_level = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    for steps in levels(load(sys.argv[1])):
        full = max(r["n"] for r in steps)
        plain = [r for r in steps if r["method"].startswith("plain") and r["kind"] == "decode"]
        policy = [r for r in steps if "adaptive" in r["method"] and r["kind"] == "decode"]
        if full < min_level or len(plain) < 3 or not policy:
            continue
        X = np.array([[1.0, r["n"], r["prompt"]] for r in plain])
        (a, b, c), *_ = np.linalg.lstsq(X, np.array([r["s"] for r in plain]), rcond=None)
        resid = np.array([r["s"] for r in plain]) - X @ np.array([a, b, c])

        def price(r: dict) -> float:
            return a + b * r["n"] + c * r["prompt"]

        per_token = price({"n": full, "prompt": 0}) / full
        print(f"level {full}: plain's steps = {a * 1e3:.1f} ms + {b * 1e3:.2f} ms x requests + {c * 1e3:.2f} ms x "
              f"prompt tokens (residual sd {resid.std() * 1e3:.0f} ms); a plain token {per_token * 1e3:.2f} ms at a full batch")
        print(f"  seconds: policy {sum(r['s'] for r in policy):.1f}, plain {sum(r['s'] for r in plain):.1f}; "
              f"steps {len(policy)} against {len(plain)}; at a full batch:")
        policy = [r for r in policy if r["n"] >= full - full // 8]
        for riders in (False, True):
            plans = [r for r in policy if r.get("admitted") and bool(r["prompt"]) == riders]
            if plans:
                extra = sum(r["s"] - price(r) for r in plans)
                gained = sum(r.get("accepted", 0) for r in plans)
                print(f"  plans {'with riders' if riders else 'quiet      '} {len(plans):4d} steps, {extra:6.2f} s beyond the price, "
                      f"{gained:5d} tokens gained: {extra / max(gained, 1) * 1e3:6.2f} ms a gained token")
        for name, keep in (("not drafted", lambda r: not r.get("drafted")), ("dropped", lambda r: r.get("drafted"))):
            rest = [r for r in policy if not r.get("admitted") and keep(r)]
            if rest:
                beyond = [r["s"] - price(r) for r in rest]
                print(f"  {name:12s} {len(rest):4d} steps, beyond the price: mean {statistics.mean(beyond) * 1e3:6.1f} ms, "
                      f"median {statistics.median(beyond) * 1e3:6.1f} ms, drafting {statistics.mean(r.get('draft_s', 0) for r in rest) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
