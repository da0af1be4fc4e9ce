#!/usr/bin/env bash
# P-EAGLE drafter for Gemma 3 270M (all 5 drafts from one forward of a 1-layer EAGLE-3-shaped head),
# trained on a 2-core CPU on the same data as drafters/gemma3-270m-eagle3 (the first N = 2,944
# prompts of datasets/gemma3-270m-mix: same samples, held-out split and 8,192-token draft vocabulary).
# It starts from the shipped EAGLE-3 head (--init-from: depth 1 of a P-EAGLE head is an EAGLE-3 head,
# so only the learned mask state of depths 2-5 starts from scratch), with LAYERS layers (default 2:
# the layer past the EAGLE-3's starts as the identity, so the head still drafts as the EAGLE-3 at
# step 0), and trains all depths at once on COD-sampled anchors (ratio 0.7, floor 0.2), KL to the
# target per depth (weights 0.8^d), STEPS steps of 8 samples (default 60, about 35 s a step in fp32
# on the AVX2-only 2-core EPYC of the run; bf16 autocast there ran 17x slower, so BF16=1 only where
# the CPU has bf16 arithmetic (AVX512-BF16 / AMX) or on a GPU). Run 1 was LAYERS=1 STEPS=130 with
# --eval-every 65, stopped at step 68; run 2 this script's defaults, stopped at step 30 (README.md).
# Resumes when re-run with the same settings (a kill is safe):
#   nohup drafters/gemma3-270m-peagle/run.sh > drafters/gemma3-270m-peagle/run.log 2>&1 &
# PYTHON is the interpreter that has verispec installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
OUT=${OUT:-drafters/gemma3-270m-peagle}
INIT=${INIT:-drafters/gemma3-270m-eagle3}
N=${N:-2944}
$PY -m verispec.cli train --method peagle --data datasets/gemma3-270m-mix --max-prompts "$N" --out "$OUT" \
    --init-from "$INIT" --draft-vocab-size 8192 --ttt-steps 5 --fc-norm --norm-output --step-loss-decay 0.8 \
    --num-layers "${LAYERS:-2}" \
    --lr "${LR:-8e-4}" --steps "${STEPS:-60}" --batch-size 8 --max-len 768 --val-fraction 0.05 --save-every 10 \
    --eval-every 30 --threads 2 --no-progress $([ "${BF16:-0}" = 1 ] || echo --no-bf16)
$PY -m verispec.cli export --vllm "$OUT"
