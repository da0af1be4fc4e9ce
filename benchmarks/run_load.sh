#!/usr/bin/env bash
# The load benchmark: concurrency 1, 2, 4, 8, 16, 32 through the continuous-batching engine in process
# and through `verispec serve` over HTTP (one server process per method each round, alive together, methods
# rotated per level), plain decoding and the n-gram drafter (k = 5), Gemma 3 270M bf16, greedy,
# 64 streamed tokens per request; the single-stream part on the first LIMIT MT-Bench + LIMIT HumanEval
# prompts, the sweep on distinct prompts from both sets (those first). Every output is checked against
# plain decoding, single-stream or batched at the same level (token ids in process, text over HTTP). Throughput vs per-user speed is plotted in load_sweep.png.
#
# The results in BENCHMARKS.md: `OUT=benchmarks/results/load benchmarks/run_load.sh` (about 11 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
VERISPEC="${VERISPEC:-verispec}"
command -v "$VERISPEC" >/dev/null || VERISPEC="$(dirname "$(command -v python3)")/verispec"
OUT="${OUT:-benchmarks/results/load-$(date -u +%Y%m%dT%H%M%SZ)}"

"$VERISPEC" bench \
    --model "${MODEL:-gemma3-270m}" --dtype bfloat16 \
    --datasets mtbench,humaneval --limit "${LIMIT:-4}" \
    --max-tokens "${MAX_TOKENS:-64}" --rounds 1 -k "${K:-5}" \
    --drafters ngram --peers none --sample-check 0 \
    --concurrency "${CONCURRENCY:-1,2,4,8,16,32}" --sweep-via engine,server --sweep-rounds "${SWEEP_ROUNDS:-1}" \
    --threads "${THREADS:-2}" \
    --report "$OUT" "$@"
