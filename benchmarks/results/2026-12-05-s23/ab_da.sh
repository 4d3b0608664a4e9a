#!/bin/bash
for r in 1 2 3; do
  for tree in /work/exp /work/main; do
    echo "== $tree round $r $(date +%T)"
    cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python benchmarks/decode_attention_bw.py 2>&1 | grep "decode_attention"
  done
done
