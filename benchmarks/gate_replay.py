"""Replay a traced in-process sweep (`benchmarks/step_trace`, see `inprocess_trace.py`) under the
realized-gain gate (a bin whose last plans realized a median under 1 + margin takes none:
`verispec.adaptive.realized.RealizedGain.losing`), applied at every load as session 32 tried it
(the policy now applies it only where nodes are dear, `AdaptiveDraftLength.DEAR_SHARE`): which
of the adaptive policy's plan steps the gate would have refused, and what that would have saved
or lost.

A rough, offline estimate, to choose the gate's record count and threshold before spending a
sweep on them. Plain decoding's steps at each level are fitted by least squares (seconds = a + b N
+ c P, as `plan_cost.py` does); a plan step's realized gain is its emitted tokens per second,
less the fitted price of its riders, over the fitted plain speed. Walking each policy's steps in
order (its batch-size bins carried from level to level, as the sweep carries the policy), a plan
is refused where its bin's fresh records, with riders or without, number `min_records` and have a
median realized gain under 1 + margin; a refused plan saves its time beyond the plain price and
loses its accepted tokens at the plain price per token. Drafting on steps the gate closes (none of
the bin's record sets winning) is counted as saved too. What the replay cannot tell: how the
refusals would have changed the steps after them (the looks, the estimator's labels).

    python benchmarks/gate_replay.py TRACE_DIR [MIN_RECORDS [MARGIN]]
"""

import statistics
import sys

import numpy as np

from inprocess_trace import levels
from plan_cost import load
from verispec.adaptive.costs import batch_bin

FORGET = 256


def main() -> None:
    directory = sys.argv[1]
    min_records = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    margin = float(sys.argv[3]) if len(sys.argv) > 3 else 0.03
    records: dict[tuple[int, bool], list[tuple[int, float]]] = {}  # (bin, riders) -> (step, realized)
    step = 0

    def fresh(key):
        return [r for at, r in records.get(key, ()) if step - at < FORGET]

    def losing(key):
        rs = fresh(key)
        return len(rs) >= min_records and statistics.median(rs) < 1 + margin

    for steps in levels(load(directory)):
        full = max(r["n"] for r in steps)
        plain = [r for r in steps if r["method"].startswith("plain") and r["kind"] == "decode"]
        if len(plain) < 3:
            continue
        X = np.array([[1.0, r["n"], r["prompt"]] for r in plain])
        (a, b, c), *_ = np.linalg.lstsq(X, np.array([r["s"] for r in plain]), rcond=None)
        for method in sorted({r["method"] for r in steps if "adaptive" in r["method"]}):
            policy = [r for r in steps if r["method"] == method and r["kind"] == "decode"]
            saved = lost = drafting = 0.0
            refused = 0
            for r in policy:
                step += 1
                key = (batch_bin(r["n"]), bool(r["prompt"]))
                sets = [k for k in ((key[0], False), (key[0], True)) if len(fresh(k)) >= min_records]
                closed = bool(sets) and all(losing(k) for k in sets)
                if not r.get("drafted") or r.get("probe"):
                    continue
                plain_s = a + b * r["n"]
                if not r.get("admitted"):
                    drafting += r.get("draft_s", 0.0) if closed else 0.0
                elif losing(key) or closed:
                    refused += 1
                    saved += r["s"] - (plain_s + c * r["prompt"])
                    lost += r["accepted"] * plain_s / r["n"]
                else:
                    spent = r["s"] - c * r["prompt"]
                    records.setdefault(key, []).append((step, (r["emitted"] / spent) / (r["n"] / plain_s)))
            total = sum(r["s"] for r in policy)
            net = saved - lost + drafting
            print(f"level {full:3d} {method:28s} {len(policy):4d} steps {total:6.1f} s: {refused:3d} plans refused, "
                  f"saving {saved:6.2f} s, losing tokens worth {lost:6.2f} s; drafting saved {drafting:5.2f} s; "
                  f"net {net:+6.2f} s ({100 * net / total:+.1f}%)")


if __name__ == "__main__":
    main()
