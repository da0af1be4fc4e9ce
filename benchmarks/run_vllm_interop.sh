#!/usr/bin/env bash
# The vLLM interop test (tests/test_vllm_interop.py: EAGLE-3 on a Llama and a Qwen3 target, P-EAGLE,
# DFlash and DSpark on Qwen3, each trained here, exported, run in vLLM's CPU build and in verispec),
# recording what it measured in benchmarks/results/vllm-interop/results.json with the export
# format's fingerprint; tests/test_vllm_interop_results.py checks that file in every CI run.
# About 15 minutes on 2 cores, after vLLM's venv (benchmarks/vllm_env.sh, made here if absent).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/vllm-interop}"
bash benchmarks/vllm_env.sh
mkdir -p "$OUT" && rm -f "$OUT/results.json"
VERISPEC_INTEROP_RECORD="$OUT" python -m pytest -q -s -m slow tests/test_vllm_interop.py 2>&1 | tee "$OUT/pytest.log"
