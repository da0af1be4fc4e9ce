#!/usr/bin/env bash
# The trained drafters (EAGLE-3, P-EAGLE, DSpark) against plain decoding, n-gram and the hybrid (n-gram
# where it matches, EAGLE-3 elsewhere), all at a fixed k = 5 chain, in one `verispec bench` run per
# temperature (every ratio paired in its run): Gemma 3 270M, bfloat16, 128 new tokens, LIMIT
# evenly spaced prompts of each of held-out chat (the benchmark's seeded ShareGPT sample, which the
# training mixture excludes), MT-Bench and HumanEval, ROUNDS rounds, methods interleaved per prompt
# with the order rotated. At temperature 0 every output is checked token for token against plain
# decoding and the sampled-output check runs (exact 3-token distribution at T=0.8, top-k 5,
# top-p 0.95 against SAMPLE_N seeded requests); at temperature 1 (seeded per prompt) the run
# measures speed and tau only.
#
# The results in BENCHMARKS.md: `OUT=benchmarks/results/trained benchmarks/run_trained.sh` (about
# 40 minutes on an idle 2-core machine; the run of session 8, EAGLE-3 only, is in
# benchmarks/results/eagle3). Smoke test: LIMIT=1 MAX_TOKENS=16 ROUNDS=1 SAMPLE_N=100 TEMPS=0
set -euo pipefail
cd "$(dirname "$0")/.."
VERISPEC="${VERISPEC:-verispec}"
command -v "$VERISPEC" >/dev/null || VERISPEC="$(dirname "$(command -v python3)")/verispec"
OUT="${OUT:-benchmarks/results/trained-$(date -u +%Y%m%dT%H%M%SZ)}"
D="${DRAFTER:-drafters/gemma3-270m-eagle3}"
methods="ngram@policy=fixed,$D@policy=fixed,hybrid:$D@policy=fixed"
for p in ${PARALLEL:-drafters/gemma3-270m-peagle drafters/gemma3-270m-dspark}; do  # parallel drafters, when trained
    [ -f "$p/config.json" ] && methods="$methods,$p@policy=fixed"
done
for h in ${HYBRID_WITH:-}; do  # more hybrids: n-gram where it matches, drafter $h elsewhere
    methods="$methods,hybrid:$h@policy=fixed"
done
for t in ${TEMPS:-0 1}; do
    extra=(--sample-check 0)
    [ "$t" = 0 ] && extra=(--sample-check "${SAMPLE_CHECK:-1}" --sample-n "${SAMPLE_N:-1000}")
    "$VERISPEC" bench \
        --model "${MODEL:-gemma3-270m}" --dtype "${DTYPE:-bfloat16}" -k 5 \
        --datasets sharegpt,mtbench,humaneval --limit "${LIMIT:-6}" --spread \
        --max-tokens "${MAX_TOKENS:-128}" --rounds "${ROUNDS:-2}" --temperature "$t" \
        --drafters "$methods" --peers none --concurrency none "${extra[@]}" \
        --threads "${THREADS:-2}" --report "$OUT/t$t"
done
