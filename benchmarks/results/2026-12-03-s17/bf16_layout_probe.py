"""Session s17 probe: bfloat16 decode attention over today's cache layout, [blocks, 16, 3 KV heads, 64] (a token's
KV heads side by side), against a head-major one (each block's 16 rows of one KV head a contiguous 2 KiB page, as
the int8 cache's pages are), emulated with the same kernel as kv_heads=1 and one "sequence" per (sequence, KV head).
W1's shapes, 30 layers with caches of their own. Run under the bench lock:

    flock /work/bench.lock .venv/bin/python benchmarks/results/2026-12-03-s17/bf16_layout_probe.py
"""

from __future__ import annotations

import statistics
import time

import conveyor  # noqa: F401  (sets the OpenMP spin count before torch loads)
import torch

from conveyor.model.native import load_kernels

LAYERS, SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 64, 9, 3, 64, 16


def block_tables(blocks_per_seq: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Each sequence's blocks, scattered at random over the cache -> [seqs, max_blocks] int64."""
    order = torch.randperm(num_blocks)
    tables = torch.zeros(len(blocks_per_seq), int(blocks_per_seq.max()), dtype=torch.int64)
    used = 0
    for i, n in enumerate(blocks_per_seq.tolist()):
        tables[i, :n] = order[used:used + n]
        used += n
    return tables


def main() -> None:
    kernels = load_kernels()
    torch.manual_seed(0)
    lens = torch.randint(32, 257, (SEQS,)) + 64  # [SEQS]
    blocks_per_seq = (lens + BLOCK - 1) // BLOCK
    num_blocks = int(blocks_per_seq.sum()) + 8
    q = torch.randn(SEQS, HEADS, HEAD_DIM).bfloat16()  # [SEQS, HEADS, HEAD_DIM]
    group = HEADS // KV_HEADS
    cases = {
        "interleaved": (q, block_tables(blocks_per_seq, num_blocks), lens,
                        [tuple(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(2))
                         for _ in range(LAYERS)]),
        "head-major": (q.view(SEQS, KV_HEADS, group, HEAD_DIM).reshape(SEQS * KV_HEADS, group, HEAD_DIM),
                       block_tables(blocks_per_seq.repeat_interleave(KV_HEADS), num_blocks * KV_HEADS),
                       lens.repeat_interleave(KV_HEADS),
                       [tuple(torch.randn(num_blocks * KV_HEADS, BLOCK, 1, HEAD_DIM).bfloat16() for _ in range(2))
                        for _ in range(LAYERS)]),
    }
    for _ in range(3):
        for name, (queries, tables, contexts, caches) in cases.items():
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for k_cache, v_cache in caches:
                    kernels.decode_attention(queries, k_cache, v_cache, tables, contexts, HEAD_DIM ** -0.5)
                times.append(time.perf_counter() - start)
            print(f"{name}: {statistics.median(times) * 1e3:.2f} ms per step ({LAYERS} layers, median of 5)",
                  flush=True)


if __name__ == "__main__":
    main()
