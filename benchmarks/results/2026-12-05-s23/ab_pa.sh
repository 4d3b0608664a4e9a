#!/bin/bash
# alternates base (/work/exp) and main on benchmarks/prefill_attention_bench.py
for r in 1 2; do
  for tree in /work/exp /work/main; do
    echo "== $tree round $r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python benchmarks/prefill_attention_bench.py --threads 1 2 --rounds 3 2>&1 | grep thread
  done
done
