#!/bin/bash
for r in 1 2 3; do
  for mode in false true; do
    echo "== async $mode round $r $(date +%T)"
    cd /work/main && timeout 600 .venv/bin/python benchmarks/w1_breakdown.py --async-batching $mode 2>&1 | grep -E "W1 wall"
  done
done
