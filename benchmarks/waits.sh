#!/usr/bin/env bash
# `verispec generate` decode tok/s (n-gram / plain, 64 tokens) per OpenMP wait policy: auto (the CLI probes the
# load), PASSIVE, default (libgomp spins); bf16 and int8; on the idle machine and beside 2 busy loops.
#   benchmarks/waits.sh | tee benchmarks/results/waits-s23/waits.txt
set -uo pipefail
cd "$(dirname "$0")/.."
for round in 1 2; do
  for loops in 0 2; do
    pids=()
    for _ in $(seq 1 "$loops"); do python3 -c 'while 1: pass' & pids+=($!); done
    sleep 1
    for pol in auto PASSIVE default; do
      for q in none int8; do
        case $pol in auto) env=();; PASSIVE) env=(OMP_WAIT_POLICY=PASSIVE);; default) env=(OMP_WAIT_POLICY=);; esac
        out=$(env "${env[@]}" verispec generate "def fibonacci(n):" --compare --ignore-eos --max-tokens 64 --quant $q 2>&1 | grep "tok/s")
        ngram=$(echo "$out" | grep ngram | sed -E 's/.*= ([0-9.]+) tok\/s.*/\1/')
        plain=$(echo "$out" | grep plain | sed -E 's/.*= ([0-9.]+) tok\/s.*/\1/')
        echo "round=$round busy_loops=$loops policy=$pol quant=$q ngram_tok_s=$ngram plain_tok_s=$plain"
      done
    done
    [ "${#pids[@]}" -gt 0 ] && kill "${pids[@]}"
    wait 2>/dev/null || true
  done
done
