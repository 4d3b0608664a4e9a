"""Decode attention alone at W1's shapes (default model: 30 layers, 64 sequences, 9 / 3 heads, head_dim 64,
contexts 96-320, blocks of 16 scattered), every layer's caches its own (so nothing stays cached between layers, as
in a real step): the exact bfloat16 cache against the int8 one, three rounds alternating. Run under the bench lock:

    flock /work/bench.lock .venv/bin/python benchmarks/results/2026-12-03-s17/kv_attention_probe.py
"""

from __future__ import annotations

import statistics
import time

import conveyor  # noqa: F401  (sets the OpenMP spin count before torch loads)
import torch

from conveyor.model import kv_int8
from conveyor.model.native import load_kernels

LAYERS, SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 64, 9, 3, 64, 16


def main() -> None:
    kernels = load_kernels()
    torch.manual_seed(0)
    lens = torch.randint(32, 257, (SEQS,)) + 64  # [SEQS] W1's prompts plus half its outputs
    blocks_per_seq = (lens + BLOCK - 1) // BLOCK
    num_blocks = int(blocks_per_seq.sum()) + 8
    order = torch.randperm(num_blocks)
    tables = torch.zeros(SEQS, int(blocks_per_seq.max()), dtype=torch.int64)  # [SEQS, max_blocks]
    used = 0
    for i in range(SEQS):
        n = int(blocks_per_seq[i])
        tables[i, :n] = order[used:used + n]
        used += n
    q = torch.randn(SEQS, HEADS, HEAD_DIM).bfloat16()  # [SEQS, HEADS, HEAD_DIM]

    def plain_cache() -> torch.Tensor:
        return torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()

    def int8_cache(keys: bool) -> torch.Tensor:
        cache = torch.zeros(kv_int8.cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.int8)
        rows = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM)
        kv_int8.write_rows(rows, cache, torch.arange(num_blocks * BLOCK), keys)
        return cache

    caches = {"bf16": [(plain_cache(), plain_cache()) for _ in range(LAYERS)],
              "int8": [(int8_cache(True), int8_cache(False)) for _ in range(LAYERS)]}
    bf16_mb = sum(2 * int(n) * KV_HEADS * HEAD_DIM * 2 for n in lens) * LAYERS / 1e6
    print(f"mean context {float(lens.float().mean()):.1f} tokens; K+V read per step: bf16 {bf16_mb:.0f} MB, "
          f"int8 {bf16_mb * (HEAD_DIM + 4) / (2 * HEAD_DIM):.0f} MB")
    for _ in range(3):
        for name, layers in caches.items():
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for k_cache, v_cache in layers:
                    kernels.decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5)
                times.append(time.perf_counter() - start)
            print(f"{name}: {statistics.median(times) * 1e3:.2f} ms per step ({LAYERS} layers, median of 5)",
                  flush=True)


if __name__ == "__main__":
    main()
