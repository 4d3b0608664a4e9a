#!/bin/bash
# s24, not kept: the float32 product's next-panel requests (f32_linear.cpp's Prefetch plan) removed, at /work/main,
# against s23's end (/work/exp), alternating; each tree's native product against torch's GEMM in one process
# (benchmarks/ab_f32_linear.py). I had read the disassembly wrongly and taken the requests for code GCC deleted;
# they are compiled (one PREFETCHT1 per k step in every block_rows<R>), and removing them makes the product
# 1.3-1.4x slower at 8-64 rows (outputs/f32_requests_removed.txt). As asm statements instead of _mm_prefetch the
# same requests made it 2.2-2.5x slower (outputs/f32_requests_real.txt). f32_linear.cpp is unchanged.
for r in 1 2; do
  for tree in /work/exp /work/main; do
    echo "== $tree round $r $(date +%T)"
    cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python benchmarks/ab_f32_linear.py --runs 5 --linears 8 64 384 2>&1 | grep -E "^(8|64|384) "
  done
done
