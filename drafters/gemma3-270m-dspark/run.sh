#!/usr/bin/env bash
# DSpark drafter for Gemma 3 270M (a 2-layer DFlash backbone drafting a block of 6 in one forward,
# a rank-32 Markov head drawing the tokens left to right, a confidence head calibrated per slot),
# trained on a 2-core CPU on the same data budget as drafters/gemma3-270m-eagle3 run 2: the first
# 1088 prompts of datasets/gemma3-270m-mix (same held-out split, same 8192-token draft vocabulary).
# Markov rank 32 because its W1 indexes the 262,144-token target vocabulary: rank 256 made a 163 MB
# checkpoint, rank 32 about 50 MB. The draft loss is KL to the target (the trainer's default) plus
# DSpark's confidence loss: with the paper's 0.1 CE + 0.9 TV (`--loss tv`) a run stayed at held-out
# position-1 acceptance 0.16 after 100 and 200 steps, and a second one with --fc-norm (a norm on each
# target state before fusion, as EAGLE 3.1; kept here) had the same training accuracy (0.05-0.18 per
# slot) after 56 steps. 3 epochs (387 steps) for the session's time; EAGLE-3 run 2 had 4.
# Resumes when re-run with the same settings (a kill is safe):
#   nohup drafters/gemma3-270m-dspark/run.sh > drafters/gemma3-270m-dspark/run.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
OUT=${OUT:-drafters/gemma3-270m-dspark}
# A longer run on run 3's EAGLE-3 data budget: N=2944 STEPS=800 OUT=data/runs/dspark-run2 (started in session 13,
# stopped at step 48 to free the CPU for engine work; not run to the end).
N=${N:-1088}
length=(--epochs "${EPOCHS:-3}")
[ -n "${STEPS:-}" ] && length=(--steps "$STEPS")
$PY -m verispec.cli train --method dspark --data datasets/gemma3-270m-mix --max-prompts "$N" --out "$OUT" \
    --draft-vocab-size 8192 --ttt-steps 6 --num-layers 2 --markov-rank 32 --fc-norm --anchors 64 --lr 8e-4 "${length[@]}" \
    --batch-size 8 --max-len 768 --val-fraction 0.05 --save-every 20 --eval-every 100 --threads 2 --no-progress
