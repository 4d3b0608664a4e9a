#!/bin/bash
# s24: pack_activations (the compact GGUF product's activations, pair-interleaved) by register transposes instead
# of a scalar scatter: /work/exp (e7807f7) against /work/main, alternating. flock /work/bench.lock bash ab_pack.sh 3
for r in $(seq 1 ${1:-3}); do
  for tree in /work/exp /work/main; do
    echo "== $tree round $r $(date +%T)"
    cd $tree && ROUNDS=1 PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python /work/main/benchmarks/results/2026-12-05-s21/gguf64.py 2>&1 | grep sum
    cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python /work/main/benchmarks/results/2026-12-05-s24/compact64.py 2>&1 | grep -E "^(qkv|o |gate|down|lm_head|total)"
  done
done
