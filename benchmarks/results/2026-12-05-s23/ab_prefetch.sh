#!/bin/bash
# prefill attention's requests ahead: /work/exp2 (dd12b61) against /work/main (the same plus the requests)
for r in 1 2 3; do
  for tree in /work/exp2 /work/main; do
    echo "== $tree round $r $(date +%T)"
    cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python benchmarks/w1_breakdown.py --async-batching false --profile 2>&1 | grep -E "with prefill|native::prefill_attention" | head -2
    cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python benchmarks/prefill_attention_bench.py --threads 2 --rounds 3 2>&1 | grep -E "W1 first|2048"
  done
done
