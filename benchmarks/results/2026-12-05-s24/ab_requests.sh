#!/bin/bash
# s24: the line requests made real (asm PREFETCH statements; GCC 12 had deleted prefill attention's loops of
# _mm_prefetch) and the rotary's cache rows requested for writing: /work/exp (1b42a41, s23's end) against
# /work/main, alternating. Run under the bench lock: flock /work/bench.lock bash ab_requests.sh 3
rounds=${1:-3}
for r in $(seq 1 $rounds); do
  for tree in /work/exp /work/main; do
    echo "== $tree round $r $(date +%T)"
    cd $tree
    T=2 PYTHONPATH=$tree timeout 300 /work/main/.venv/bin/python /work/main/benchmarks/results/2026-12-05-s24/small_ops.py 2>&1 | grep rotary
    PYTHONPATH=$tree timeout 300 /work/main/.venv/bin/python benchmarks/decode_attention_bw.py 2>&1 | grep "decode_attention x"
    PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python benchmarks/prefill_attention_bench.py --threads 2 --rounds 3 2>&1 | grep -E "W1 first|2048|512|16 x 128"
    PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python benchmarks/w1_breakdown.py --async-batching false --profile 2>&1 | grep -E "W1 wall|with prefill|64-row|native::prefill_attention|native::rotary_and_cache" | head -8
  done
done
