"""How close does the native decode attention read the paged KV cache to a plain streaming read of the same bytes?

At W1's shape (default model: 3 KV heads of 64, 9 query heads, 64 sequences, ~210 tokens of context each,
blocks scattered over the cache), against a torch sum over a contiguous bfloat16 tensor of the same size, and
the bfloat16 argmax over the 64 x 49,152 logits as the sampler takes it. Prints medians of alternating calls.

    .venv/bin/python benchmarks/kernels/decode_attention_bw.py [--seqs 64] [--context 210]
        [--heads 9 --kv-heads 3 --dim 64] [--block 16] [--threads N]

Other shapes: the 1B model's --heads 32 --kv-heads 8; one long context --seqs 1 --context 4000; --threads 1
for a measure that the other processes of a shared machine disturb less (a 2-thread call waits for both cores).
Needs the native kernels (AVX-512; any CPU the kernels build on).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import conveyor  # noqa: F401  (OpenMP spin count before torch loads)
from conveyor.model.native import load_kernels


def median_ms(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=210)
    parser.add_argument("--layers", type=int, default=30, help="caches to rotate through (defeats the L2/L3)")
    parser.add_argument("--heads", type=int, default=9, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64, help="head_dim")
    parser.add_argument("--block", type=int, default=16, help="block_size of the cache")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_kernels()
    torch.manual_seed(0)
    block, kv_heads, heads, dim = args.block, args.kv_heads, args.heads, args.dim
    blocks_per_seq = -(-args.context // block)
    num_blocks = args.seqs * blocks_per_seq + 8
    caches = [
        (
            torch.randn(num_blocks, block, kv_heads, dim).to(torch.bfloat16),
            torch.randn(num_blocks, block, kv_heads, dim).to(torch.bfloat16),
        )
        for _ in range(args.layers)
    ]
    tables = torch.randperm(num_blocks)[: args.seqs * blocks_per_seq].view(args.seqs, blocks_per_seq).contiguous()
    lens = torch.full((args.seqs,), args.context, dtype=torch.int64)  # [seqs]
    q = torch.randn(args.seqs, heads, dim).to(torch.bfloat16)
    read = 2 * args.seqs * args.context * kv_heads * dim * 2  # K and V bytes of one layer

    def attention() -> None:
        for k, v in caches:
            kernels.decode_attention(q, k, v, tables, lens, dim**-0.5)

    flat = torch.randn(args.layers * read // 2).to(torch.bfloat16)

    def stream() -> None:
        flat.sum()

    logits = torch.randn(args.seqs, 49152).to(torch.bfloat16)
    for name, fn, nbytes in (
        ("decode_attention x layers", attention, read * args.layers),
        ("streaming read (sum)", stream, flat.numel() * 2),
    ):
        ms = median_ms(fn, 10)
        print(f"{name:28s} {ms:8.2f} ms  {nbytes / ms / 1e6:6.1f} GB/s ({nbytes / 1e6:.0f} MB)")
    print(f"{'argmax bf16 (max.indices)':28s} {median_ms(lambda: logits.max(dim=-1).indices):8.3f} ms")
    if hasattr(kernels, "argmax_rows"):
        print(f"{'argmax bf16 (native)':28s} {median_ms(lambda: kernels.argmax_rows(logits)):8.3f} ms")


if __name__ == "__main__":
    main()
