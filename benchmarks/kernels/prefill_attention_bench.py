"""Is the native prefill attention (csrc/prefill_attention.cpp) faster than torch's fused SDPA on the engine's
prompt chunks?

Torch's kernel is called once per prompt chunk, as paged_attention calls it without the native op; bfloat16,
fresh prompts (K/V already in a paged cache for ours, contiguous for SDPA), one layer's call; median ms of
alternating rounds. Needs AMX (the native prefill attention runs on AMX tiles).

    .venv/bin/python benchmarks/kernels/prefill_attention_bench.py [--threads 1 2] [--rounds 5]

Shapes: W1's first step (13 prompts of 32-256 tokens, 9/3 heads of 64: the default model), the 1B model (32/8
heads of 64) with 16 prompts of 128 and one of 512, one 2048-token prompt, and head_dim 128.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F
from decode_attention_bw import median_ms  # the sibling script's timer (benchmarks/kernels/ is on sys.path when run)

import conveyor  # noqa: F401  (sets the OpenMP spin count before torch loads)
from conveyor.model.attention import build_attention_batch
from conveyor.model.native import load_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    kernels = load_kernels()
    if not kernels.prefill_attention_available():
        raise SystemExit("the native prefill attention needs AMX-BF16, which this machine does not grant")
    rng = random.Random(0)
    shapes = [
        ("W1 first step: 13 prompts of 32-256", 9, 3, 64, [rng.randint(32, 256) for _ in range(13)]),
        ("1B: 16 prompts of 128", 32, 8, 64, [128] * 16),
        ("1B: one prompt of 512", 32, 8, 64, [512]),
        ("one prompt of 2048, 9/3 heads", 9, 3, 64, [2048]),
        ("head_dim 128: one of 1024, 16/4 heads", 16, 4, 128, [1024]),
    ]
    block = 16
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, heads, kv_heads, dim, lengths in shapes:
            torch.manual_seed(0)
            tokens = sum(lengths)
            qkv = torch.randn(tokens, heads + 2 * kv_heads, dim).bfloat16()  # [tokens, heads + 2 kv_heads, d]
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
            tables, first = [], 0
            for n in lengths:
                tables.append(list(range(first, first + -(-n // block))))
                first += len(tables[-1])
            k_cache = torch.zeros(first, block, kv_heads, dim, dtype=torch.bfloat16)
            v_cache = torch.zeros_like(k_cache)
            batch = build_attention_batch([0] * len(lengths), lengths, tables, block)
            k_cache.view(-1, kv_heads, dim)[batch.slot_mapping] = k
            v_cache.view(-1, kv_heads, dim)[batch.slot_mapping] = v
            out = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
            # every chunk to the kernel, whatever its length (the engine sends only those up to
            # NATIVE_PREFILL_MAX_CONTEXT: this measures where that limit should be)
            spans = torch.tensor([[c.token_start, c.num_tokens, c.context_len] for c in batch.prefills])  # [chunks, 3]
            width = max(len(t) for t in tables)
            block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [chunks, width]

            def sdpa() -> None:
                for chunk in batch.prefills:
                    rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
                    o = F.scaled_dot_product_attention(
                        q[rows].transpose(0, 1)[None],
                        k[rows].transpose(0, 1)[None],
                        v[rows].transpose(0, 1)[None],
                        is_causal=True,
                        scale=dim**-0.5,
                        enable_gqa=heads != kv_heads,
                    )
                    out[rows] = o[0].transpose(0, 1)

            def native() -> None:
                kernels.prefill_attention(q, k_cache, v_cache, block_tables, spans, dim**-0.5, 0, out)

            pairs = [(median_ms(sdpa, 5), median_ms(native, 5)) for _ in range(args.rounds)]
            torch_ms = statistics.median(p[0] for p in pairs)
            ours_ms = statistics.median(p[1] for p in pairs)
            print(
                f"{threads} thread(s), {name}: torch SDPA per chunk {torch_ms:7.2f} ms, native {ours_ms:7.2f} ms "
                f"({torch_ms / ours_ms:.2f}x)"
            )


if __name__ == "__main__":
    main()
