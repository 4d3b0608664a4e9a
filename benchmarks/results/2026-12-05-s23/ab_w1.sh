#!/bin/bash
# usage: ab_w1.sh ROUNDS EXTRA_ARGS... ; alternates /work/main and /work/exp, sync w1_breakdown
rounds=$1; shift
for r in $(seq $rounds); do
  for tree in /work/main /work/exp; do
    echo "== $tree round $r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python benchmarks/w1_breakdown.py --async-batching false "$@" 2>&1 | grep -E "W1 wall|with prefill|decode-only|64-row"
  done
done
