"""Per-method step breakdown of an in-process sweep traced by `benchmarks/step_trace`
(`PYTHONPATH=benchmarks/step_trace VERISPEC_STEP_TRACE=DIR ... benchmarks/run_adaptive.sh` with
VIA=engine): at each level, every method's timed steps (each engine's warm-up left out: the steps
before the level's last-built engine finished its own) split as quiet or carrying prompt chunks
("rider"), and under the adaptive policy by whether a plan was verified, a probe, or nothing
(drafted and dropped, or not drafted). For each split: steps, seconds, mean batch size, tokens
emitted and their rate, and the median step time at a full batch (within an eighth of the level).

    python benchmarks/inprocess_trace.py DIR

The first "level" is the single-stream part of the run (`verispec bench` runs it before the sweep).
"""

import gzip
import json
import statistics
import sys
from pathlib import Path


def split(r: dict) -> str:
    base = "rider" if r["prompt"] else "quiet"
    if r.get("probe"):
        return base + "+probe"
    if r.get("admitted"):
        return base + "+plan"
    if r.get("drafted"):
        return base + "+dropped"
    return base


def levels(records: list[dict]) -> list[list[dict]]:
    """The timed steps of each level: engines are numbered by their first step, and the sweep warms
    each engine as it builds it, one after another, before the level's engines alternate; so a
    level is a run of engine numbers, and its timed part starts when another engine steps after
    the last one's warm-up."""
    by_engine: dict[int, list[dict]] = {}
    for r in records:
        if "method" in r:
            by_engine.setdefault(int(r["method"].rsplit("#", 1)[1]), []).append(r)
    out, group = [], []
    for no in sorted(by_engine):
        recs = by_engine[no]
        if group and recs[0]["t"] > max(x["t"] for g in group for x in by_engine[g]):  # after the level ended
            out.append(group)
            group = []
        group.append(no)
    out.append(group)
    timed = []
    for group in out:
        last = by_engine[group[-1]]  # built and warmed last: the timed steps start with another engine's
        start = min((r["t"] for g in group[:-1] for r in by_engine[g] if r["t"] > last[0]["t"]), default=last[0]["t"])
        timed.append(sorted((r for g in group for r in by_engine[g] if r["t"] >= start), key=lambda r: r["t"]))
    return timed


def main() -> None:
    records = []
    for f in sorted(Path(sys.argv[1]).glob("*.json*")):  # .json, or .json.gz as kept in benchmarks/results
        data = json.loads(gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_text())
        records += data["records"]
    records.sort(key=lambda r: r["t"])
    for steps in levels(records):
        if not steps:
            continue
        full = max(r["n"] for r in steps)
        print(f"level {full}:")
        methods = sorted({r["method"] for r in steps})
        for m in methods:
            rs = [r for r in steps if r["method"] == m and r["kind"] == "decode"]
            emitted = sum(r.get("emitted", 0) for r in rs)
            secs = sum(r["s"] for r in steps if r["method"] == m)
            print(f"  {m:40s} {len(rs):4d} steps {secs:7.2f} s  emitted {emitted:6d}  {emitted / secs:6.1f} tok/s")
            groups: dict[str, list[dict]] = {}
            for r in rs:
                groups.setdefault(split(r), []).append(r)
            for k, g in sorted(groups.items()):
                at_full = [r["s"] for r in g if r["n"] >= full - full // 8]
                gs = sum(r["s"] for r in g)
                em = sum(r.get("emitted", 0) for r in g)
                print(f"     {k:14s} {len(g):4d} steps {gs:7.2f} s  n {statistics.mean(r['n'] for r in g):5.1f}"
                      f"  prompt {statistics.mean(r['prompt'] for r in g):6.1f}  admitted {statistics.mean(r.get('admitted', 0) for r in g):5.1f}"
                      f"  emitted {em:5d} {em / gs if gs else 0:6.1f} tok/s"
                      f"  full-batch step {statistics.median(at_full) * 1e3 if at_full else float('nan'):6.1f} ms"
                      f"  draft {sum(r.get('draft_s', 0) for r in g) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
