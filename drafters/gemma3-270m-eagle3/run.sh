#!/usr/bin/env bash
# EAGLE-3 drafter for Gemma 3 270M, trained on a 2-core CPU (run 3 = run 2, then warm-started on
# all of the data). Every stage resumes when the script is re-run with the same settings (a kill at
# any point is safe):
#   nohup drafters/gemma3-270m-eagle3/run.sh > drafters/gemma3-270m-eagle3/run.log 2>&1 &
# 1. (only if datasets/gemma3-270m-mix holds fewer than N prompts) extend it: answers regenerated
#    by the target (greedy, <= 256 tokens, 64 streams), token ids only;
# 2. run 2: from scratch on the first 1,088 prompts (17 shards, fp32-regenerated), 4 epochs, into $RUN2;
# 3. run 3: from run 2's weights on the first N prompts (--max-prompts: the data set may hold more),
#    1.5 epochs at a lower peak LR, into $OUT
#    (checkpoint/ every 20 steps, train_log.jsonl, eval_log.jsonl, training_curves.png);
# 4. print the vLLM command.
# PYTHON is the interpreter that has verispec installed. gpu.sh is a one-stage recipe for a CUDA
# machine (from scratch, 4 epochs, after regenerating more data).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
DATA=datasets/gemma3-270m-mix
OUT=${OUT:-drafters/gemma3-270m-eagle3}
RUN2=${RUN2:-data/runs/eagle3-run2}
N=${N:-2944}          # prompts of the mix (run 3 used the first 2,944; a multiple of the 64-prompt shards)
common=(--method eagle3 --data "$DATA" --draft-vocab-size 8192 --ttt-steps 5 --fc-norm --norm-output
        --step-loss-decay 0.8 --batch-size 8 --max-len 768 --val-fraction 0.05 --save-every 20 --threads 2 --no-progress)
done_prompts=$($PY -c "import json; print(json.load(open('$DATA/index.json'))['prompts_done'])")
if [ "$done_prompts" -lt "$N" ]; then
    $PY -m verispec.cli data --model gemma3-270m --dtype bfloat16 --prompts mix --num-samples "$N" --max-tokens 256 \
        --max-prompt-tokens 512 --batch-size 64 --shard-size 64 --no-hidden --threads 2 --out "$DATA"
fi
if [ ! -f "$RUN2/eval.json" ]; then
    $PY -m verispec.cli train "${common[@]}" --out "$RUN2" --max-prompts 1088 --lr 8e-4 --epochs 4 --eval-every 100
fi
$PY -m verispec.cli train "${common[@]}" --out "$OUT" --init-from "$RUN2" --max-prompts "$N" --lr 5e-4 --epochs 1.5 --eval-every 175
$PY -m verispec.cli export --vllm "$OUT"
