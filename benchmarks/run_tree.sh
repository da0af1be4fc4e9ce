#!/usr/bin/env bash
# Chain against token tree at equal node budgets (8, 16, 32), per drafter, in one `verispec bench` run
# (every ratio paired in one run): Gemma 3 270M, bfloat16, greedy, 128 new tokens, the first LIMIT
# MT-Bench questions + the first LIMIT HumanEval problems, ROUNDS rounds, methods interleaved per
# prompt with the order rotated. Every greedy output is checked token for token against plain
# decoding; the sampled-output check runs on the tree methods (exact 3-token distribution at T=0.8,
# top-k 5, top-p 0.95 against SAMPLE_N seeded requests). No peers (run_core.sh has them).
#
# The results in BENCHMARKS.md: `OUT=benchmarks/results/tree benchmarks/run_tree.sh` (about 25 minutes on an
# idle 2-core machine). Smoke test: LIMIT=1 MAX_TOKENS=16 ROUNDS=1 SAMPLE_N=100 benchmarks/run_tree.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERISPEC="${VERISPEC:-verispec}"
command -v "$VERISPEC" >/dev/null || VERISPEC="$(dirname "$(command -v python3)")/verispec"
OUT="${OUT:-benchmarks/results/tree-$(date -u +%Y%m%dT%H%M%SZ)}"
TREE="${TREE:-dynamic:4}"
methods="ngram@k=5"
for k in ${BUDGETS:-8 16 32}; do
    methods="$methods,ngram@k=$k,ngram@tree=$TREE@k=$k"
done
for d in ${MODEL_DRAFTERS:-}; do  # e.g. MODEL_DRAFTERS="drafters/gemma3-270m-eagle3 layerskip:6"
    for k in ${BUDGETS:-8 16 32}; do methods="$methods,$d@k=$k,$d@tree=$TREE@k=$k"; done
done

"$VERISPEC" bench \
    --model "${MODEL:-gemma3-270m}" --dtype bfloat16 \
    --datasets mtbench,humaneval --limit "${LIMIT:-5}" \
    --max-tokens "${MAX_TOKENS:-128}" --rounds "${ROUNDS:-2}" \
    --drafters "$methods" \
    --peers none \
    --sample-check "${SAMPLE_CHECK:-1}" --sample-n "${SAMPLE_N:-1000}" \
    --concurrency none \
    --threads "${THREADS:-2}" \
    --report "$OUT" "$@"
