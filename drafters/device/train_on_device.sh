#!/usr/bin/env bash
# Runs on a lent GPU machine (the `device` tool; see README.md here): reassembles the target's GGUF
# from the parts the earlier calls carried (benchmarks/device/target.sh: /tmp/g/p0-p4, `.gpu/p4` carried
# with this one), checks its sha256, trains DSpark and DFlash side by side (drafters/gpu_parallel.sh, BUDGET seconds each)
# and packs DSpark's drafter into $OUT (pack.sh; DFlash's comes back in the next call).
set -uo pipefail
BUDGET=${1:-450}
source benchmarks/device/target.sh
BUDGET=$BUDGET OUT_ROOT=/tmp/runs THREADS=6 PYTHON=python3 bash drafters/gpu_parallel.sh; echo "training rc=$?"
nvidia-smi --query-gpu=memory.used --format=csv
bash drafters/device/pack.sh dspark-gpu
