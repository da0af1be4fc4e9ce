#!/usr/bin/env bash
# The quick start on an idle machine and on a busy one: 0, 1 and 2 CPU-bound loops (python3 -c
# 'while 1: pass') beside it, default threads and --threads 1, ROUNDS rounds interleaved. Prints
# decode tok/s of n-gram and plain per run. The table in README.md ("Threads on a shared
# machine") came from `benchmarks/busy_machine.sh` with ROUNDS=2 on an otherwise idle 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VERISPEC="${VERISPEC:-verispec}"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for loops in 0 1 2; do
    pids=()
    for _ in $(seq 1 "$loops"); do python3 -c 'while 1: pass' & pids+=($!); done
    sleep 1
    for threads in default 1; do
      extra=(); [ "$threads" = 1 ] && extra=(--threads 1)
      out=$("$VERISPEC" generate "def fibonacci(n):" --compare --ignore-eos --max-tokens "${MAX_TOKENS:-64}" "${extra[@]}" 2>&1 | grep "tok/s")
      ngram=$(echo "$out" | grep ngram | sed -E 's/.*= ([0-9.]+) tok\/s.*/\1/')
      plain=$(echo "$out" | grep plain | sed -E 's/.*= ([0-9.]+) tok\/s.*/\1/')
      echo "round=$round busy_loops=$loops threads=$threads ngram_tok_s=$ngram plain_tok_s=$plain"
    done
    [ "${#pids[@]}" -gt 0 ] && kill "${pids[@]}"
    wait 2>/dev/null || true
  done
done
