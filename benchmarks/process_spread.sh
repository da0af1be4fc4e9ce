#!/usr/bin/env bash
# How much the same plain decoding differs from process to process (separate servers of a sweep
# are separate processes): N processes each, alternating, with PyTorch's huge pages
# (THP_MEM_ALLOC_ENABLE=1) and without; each prints its tok/s at one batch size (median of its
# rounds). The spread of each variant's processes is what separate-process A/B runs carry as noise.
#
#   benchmarks/process_spread.sh OUT_DIR [N] [BATCH]      (defaults: 5 processes each, batch 32)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$1"; N="${2:-5}"; BATCH="${3:-32}"
mkdir -p "$OUT"
one() {  # $1: default | thp
    if [ "$1" = thp ]; then export THP_MEM_ALLOC_ENABLE=1; else unset THP_MEM_ALLOC_ENABLE; fi
    python benchmarks/engine_throughput.py --batch "$BATCH" --tokens 32 --rounds 3 --threads 2 2>/dev/null \
        | sed "s/^{/{\"variant\": \"$1\", /" | tee -a "$OUT/process_spread.jsonl"
}
for i in $(seq "$N"); do
    if [ $((i % 2)) = 1 ]; then one default; one thp; else one thp; one default; fi
done
python - "$OUT/process_spread.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for v in ("default", "thp"):
    xs = [r["tok_s"] for r in rows if r["variant"] == v]
    if xs:
        print(f"{v:8s} {len(xs)} processes: median {statistics.median(xs):.1f} tok/s, min {min(xs):.1f}, max {max(xs):.1f}, "
              f"max/min {max(xs) / min(xs):.3f}, stdev/mean {statistics.pstdev(xs) / statistics.mean(xs):.3f}")
PY
