#!/usr/bin/env bash
# Transparent huge pages for PyTorch's large CPU allocations (THP_MEM_ALLOC_ENABLE=1: allocations of
# 2 MB and more are aligned and madvised MADV_HUGEPAGE, the weights among them) against the default,
# on a kernel whose THP mode is `madvise`: plain decoding's tok/s, processes alternating.
#
#   benchmarks/thp_ab.sh OUT_DIR [ROUNDS] [BATCHES]      (defaults: 3 rounds, batches "1 64")
#
# Each round runs engine_throughput.py once without and once with the variable (the order
# alternating from round to round) and appends its JSON lines, tagged, to OUT_DIR/thp_ab.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$1"; ROUNDS="${2:-3}"; BATCHES="${3:-1 64}"
mkdir -p "$OUT"
cat /sys/kernel/mm/transparent_hugepage/enabled > "$OUT/thp_mode.txt" 2>/dev/null || true
one() {  # $1: default | thp
    if [ "$1" = thp ]; then export THP_MEM_ALLOC_ENABLE=1; else unset THP_MEM_ALLOC_ENABLE; fi
    python benchmarks/engine_throughput.py --batch $BATCHES --tokens 64 --rounds 3 --threads 2 \
        | sed "s/^{/{\"variant\": \"$1\", /" | tee -a "$OUT/thp_ab.jsonl"
}
for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then one default; one thp; else one thp; one default; fi
done
