#!/bin/bash
# s24: the 1B Q4_K_M W1 (synchronous, by step) with the vectorized pack_activations: /work/exp (e7807f7) against
# /work/main, alternating. flock /work/bench.lock bash ab_pack_w1.sh 2
for r in $(seq 1 ${1:-2}); do
  for tree in /work/exp /work/main; do
    echo "== $tree round $r $(date +%T)"
    cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python benchmarks/w1_breakdown.py --async-batching false --model /work/ckpt/llama-1b-q4_k_m.gguf --input-len 32:128 --output-len 32 --max-model-len 1024 2>&1 | grep -E "W1 wall|with prefill|64-row"
  done
done
