#!/usr/bin/env bash
# Runs on a lent GPU machine (the `device` tool; see README.md here): reassembles the target's GGUF
# from the parts the earlier calls carried (/tmp/g/p0-p4, `.gpu/p4` carried with this one), checks
# its sha256, trains DSpark and DFlash side by side (drafters/gpu_parallel.sh, BUDGET seconds each)
# and packs DSpark's drafter into $OUT (pack.sh; DFlash's comes back in the next call).
set -uo pipefail
BUDGET=${1:-450}
mkdir -p /tmp/g
for f in .gpu/p?; do [ -f "$f" ] && mv "$f" /tmp/g/; done
ls -la /tmp/g
mkdir -p /tmp/vcache/gguf
cat /tmp/g/p0 /tmp/g/p1 /tmp/g/p2 /tmp/g/p3 /tmp/g/p4 > /tmp/vcache/gguf/gemma-3-270m-q4_k_m.gguf
echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  /tmp/vcache/gguf/gemma-3-270m-q4_k_m.gguf" | sha256sum -c || exit 3
[ -d /tmp/site ] || cp -r .gpu/site /tmp/site
export VERISPEC_CACHE=/tmp/vcache PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
BUDGET=$BUDGET OUT_ROOT=/tmp/runs THREADS=6 PYTHON=python3 bash drafters/gpu_parallel.sh; echo "training rc=$?"
nvidia-smi --query-gpu=memory.used --format=csv
bash drafters/device/pack.sh dspark-gpu
