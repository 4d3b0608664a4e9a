"""s28: s25's head_major_blocks.py with every cache on huge pages (madvise, as the engine's caches are).

The decode attention at W1's shape (64 sequences x ~210 tokens, 9 query / 3 KV heads of 64, 30 layers' caches in
turn, blocks in a random order) with today's cache layout [blocks, block_size, kv_heads, head_dim] against a
head-major one [blocks, kv_heads, block_size, head_dim] (each block's rows of one KV head contiguous), emulated with
today's kernel: one cache of blocks x kv_heads single-head blocks, head h of block b at single-head block 3 b + h,
one call per KV head (its query group) with its own block table. Larger blocks give longer contiguous runs per
(sequence, KV head): block_size x 128 bytes.

    head_major_blocks.py [ROUNDS]
"""
import statistics, sys, time
import conveyor  # noqa: F401
from conveyor.host_memory import advise_huge_pages
import torch
from conveyor.model.native import load_kernels

k = load_kernels()
torch.manual_seed(0)
seqs, context, layers, heads, kv_heads, dim = 64, 210, 30, 9, 3, 64
group = heads // kv_heads
q = torch.randn(seqs, heads, dim).to(torch.bfloat16)
q_groups = [q[:, h * group:(h + 1) * group].contiguous() for h in range(kv_heads)]
lens = torch.full((seqs,), context, dtype=torch.int64)


def cache(*shape: int) -> torch.Tensor:
    t = torch.empty(*shape, dtype=torch.bfloat16)
    advise_huge_pages(t.data_ptr(), t.numel() * 2)
    return t.copy_(torch.randn(*shape))


def setup(block: int, head_major: bool):
    per_seq = -(-context // block)
    num_blocks = seqs * per_seq + 8
    table = torch.randperm(num_blocks)[:seqs * per_seq].view(seqs, per_seq).contiguous()
    if not head_major:
        caches = [(cache(num_blocks, block, kv_heads, dim), cache(num_blocks, block, kv_heads, dim))
                  for _ in range(layers)]
        return lambda: [k.decode_attention(q, kc, vc, table, lens, dim ** -0.5) for kc, vc in caches]
    caches = [(cache(num_blocks * kv_heads, block, 1, dim), cache(num_blocks * kv_heads, block, 1, dim))
              for _ in range(layers)]
    tables = [(table * kv_heads + h).contiguous() for h in range(kv_heads)]
    return lambda: [k.decode_attention(q_groups[h], kc, vc, tables[h], lens, dim ** -0.5)
                    for kc, vc in caches for h in range(kv_heads)]


def median_ms(fn, repeats=15):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


variants = [(16, False), (64, False), (16, True), (32, True), (64, True), (128, True)]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
for r in range(rounds):
    line = f"round {r}:"
    for block, head_major in variants:
        fn = setup(block, head_major)
        line += f"  {'head-major' if head_major else 'today'} {block}: {median_ms(fn):6.2f}"
        del fn
    print(line + "  ms per 30 layers", flush=True)
