#!/usr/bin/env bash
# DSpark and DFlash for Gemma 3 270M on one CUDA GPU, side by side, inside one time budget: the
# parallel drafters of issue #11 at the data budget of the shipped EAGLE-3 (run 3: the first 2,944
# prompts of datasets/gemma3-270m-mix, its held-out split and its 8,192-token draft vocabulary).
# Each trainer times its first steps and fits its cosine schedule to the steps that fit in BUDGET
# seconds (`--time-budget`), so the two finish together, evaluated, calibrated (DSpark) and exported.
#   BUDGET=450 OUT_ROOT=data/runs drafters/gpu_parallel.sh
# Both run at a 6-token block, 2 drafter layers, the target's layers [2, 9, 15] normalized before
# fusion (--fc-norm), 64 random anchor blocks a sample, forward KL to the target (the trainer's
# default; DSpark's own 0.1 CE + 0.9 TV did not learn from scratch, drafters/gemma3-270m-dspark/README.md),
# DSpark with a rank-32 Markov head. A re-run with the same settings resumes each from its checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-450}
OUT_ROOT=${OUT_ROOT:-data/runs}
N=${N:-2944}
THREADS=${THREADS:-4}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT_ROOT"
common=(--data datasets/gemma3-270m-mix --max-prompts "$N" --device "$DEVICE" --draft-vocab-size 8192 --ttt-steps 6
        --num-layers 2 --fc-norm --anchors 64 --lr 8e-4 --batch-size 16 --epochs 40 --max-len 768 --val-fraction 0.05
        --save-every 200 --eval-every 500 --time-budget "$BUDGET" --state-cache-gb 24 --threads "$THREADS" --no-progress)
# the target's conversion (GGUF -> Hugging Face folder) once, before two processes would race for it
$PY -c "from verispec.models.loading import hf_folder; print('target:', hf_folder('gemma3-270m'))"
$PY -m verispec.cli train --method dspark --markov-rank 32 --out "$OUT_ROOT/dspark-gpu" "${common[@]}" \
    > "$OUT_ROOT/dspark-gpu.log" 2>&1 &
p1=$!
$PY -m verispec.cli train --method dflash --out "$OUT_ROOT/dflash-gpu" "${common[@]}" \
    > "$OUT_ROOT/dflash-gpu.log" 2>&1 &
p2=$!
rc=0
wait $p1 || rc=$?
wait $p2 || rc=$?
tail -n 5 "$OUT_ROOT/dspark-gpu.log" "$OUT_ROOT/dflash-gpu.log"
exit $rc
