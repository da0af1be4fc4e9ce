#!/usr/bin/env bash
# On a lent GPU machine (the `device` tool; benchmarks/device/README.md), after the calls that carried
# the target's parts: the engine on CUDA against transformers on the same GPU, in one `verispec
# bench` run (one command of at most 10 minutes): plain decoding, n-gram speculation (the adaptive
# policy and fixed k = 5) and transformers' plain and prompt-lookup generate, interleaved per prompt,
# greedy outputs checked token for token against plain decoding (--strict: exit 1 on a mismatch),
# the sampled-output distribution check, and a load sweep. The report lands in $OUT/gpu-bench
# (report.json, report.md, plots). Knobs, for a dry run on a CPU (DEVICE=cpu) or a shorter run:
#   DEVICE=cuda LIMIT=5 MAX_TOKENS=128 ROUNDS=2 CONCURRENCY=1,8,64 SAMPLE_N=1000 bash benchmarks/device/gpu_bench.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device/target.sh
REPORT=${REPORT:-${OUT:-/tmp}/gpu-bench}
set -x
python3 -m verispec.cli bench --model gemma3-270m --device "${DEVICE:-cuda}" --dtype bfloat16 \
    --datasets mtbench,humaneval --limit "${LIMIT:-5}" --max-tokens "${MAX_TOKENS:-128}" --rounds "${ROUNDS:-2}" -k 5 \
    --drafters ngram,ngram@policy=fixed --peers hf,hf-pld --sample-check 2 --sample-n "${SAMPLE_N:-1000}" \
    --concurrency "${CONCURRENCY:-1,8,64}" --report "$REPORT" --strict
