#!/usr/bin/env bash
# Adaptive verification under load: concurrency 1, 2, 4, 8, 16, 32, 64 through the engine in process
# and through `verispec serve` over HTTP; plain decoding, the n-gram drafter with fixed k = 1, 3, 5, 7,
# and the adaptive policy (k <= 7). Gemma 3 270M bf16, greedy, 64 streamed tokens per request; the
# single-stream part on the first LIMIT MT-Bench + LIMIT HumanEval prompts, the sweep on distinct
# prompts from both sets (those first). Every output is checked against plain decoding (single-stream,
# or batched at the same level). Throughput against per-user speed is plotted in load_sweep.png.
#
# The verify cost profile is measured first on the idle machine (`verispec profile --remeasure`), so
# that the adaptive runs plan with the costs of this machine at rest, and up to 1,024 tokens, the
# largest forward of a 64-request engine with k = 7 and a 256-token chunk (`engine.profile_tokens`):
# measured to 512 only, every adaptive server measured the rest as it started, in the sweep.
#
# The results in BENCHMARKS.md: `OUT=benchmarks/results/adaptive benchmarks/run_adaptive.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
VERISPEC="${VERISPEC:-verispec}"
command -v "$VERISPEC" >/dev/null || VERISPEC="$(dirname "$(command -v python3)")/verispec"
OUT="${OUT:-benchmarks/results/adaptive-$(date -u +%Y%m%dT%H%M%SZ)}"
CONCURRENCY="${CONCURRENCY:-1,2,4,8,16,32,64}"
mkdir -p "$OUT"

"$VERISPEC" profile --model "${MODEL:-gemma3-270m}" --dtype bfloat16 --threads "${THREADS:-2}" --remeasure \
    --max-tokens 1024 --max-batch-size 64 --plot "$OUT/cost_profile.png" | tee "$OUT/cost_profile.txt"

"$VERISPEC" bench \
    --model "${MODEL:-gemma3-270m}" --dtype bfloat16 \
    --datasets mtbench,humaneval --limit "${LIMIT:-4}" \
    --max-tokens "${MAX_TOKENS:-64}" --rounds 1 -k 7 \
    --drafters "ngram@k=1@policy=fixed,ngram@k=3@policy=fixed,ngram@k=5@policy=fixed,ngram@k=7@policy=fixed,ngram@k=7" \
    --peers none --sample-check 0 \
    --concurrency "$CONCURRENCY" --sweep-via "${VIA:-engine,server}" --sweep-rounds "${SWEEP_ROUNDS:-1}" \
    --threads "${THREADS:-2}" \
    --report "$OUT" "$@"
