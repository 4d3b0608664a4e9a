"""Session s17 probe: bf16 decode attention: today's layout [blocks, 16, 3 heads, 64] against a head-major one (each (block, head) a
contiguous 2 KiB page), emulated as kv_heads=1 with one 'sequence' per (sequence, KV head)."""
import statistics, time
import conveyor  # noqa
import torch
from conveyor.model.native import load_kernels
K = load_kernels()
torch.manual_seed(0)
L, S, H, KVH, D, BS = 30, 64, 9, 3, 64, 16
lens = torch.randint(32, 257, (S,)) + 64
bps = (lens + BS - 1) // BS
nb = int(bps.sum()) + 8
def tables_for(nseq, blocks_per, total):
    order = torch.randperm(total)
    t = torch.zeros(nseq, int(blocks_per.max()), dtype=torch.int64); used = 0
    for i in range(nseq):
        n = int(blocks_per[i]); t[i, :n] = order[used:used + n]; used += n
    return t
q = torch.randn(S, H, D).bfloat16()
tab = tables_for(S, bps, nb)
plain = [(torch.randn(nb, BS, KVH, D).bfloat16(), torch.randn(nb, BS, KVH, D).bfloat16()) for _ in range(L)]
# head-major: S*KVH sequences of group 3, kv_heads 1
lens2 = lens.repeat_interleave(KVH); bps2 = bps.repeat_interleave(KVH)
tab2 = tables_for(S * KVH, bps2, nb * KVH)
q2 = q.view(S, KVH, H // KVH, D).reshape(S * KVH, H // KVH, D)
paged = [(torch.randn(nb * KVH, BS, 1, D).bfloat16(), torch.randn(nb * KVH, BS, 1, D).bfloat16()) for _ in range(L)]
for _ in range(3):
    for name, caches, qq, tt, ll in (("interleaved", plain, q, tab, lens), ("head-major", paged, q2, tab2, lens2)):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for k, v in caches: K.decode_attention(qq, k, v, tt, ll, 0.125)
            ts.append(time.perf_counter() - t0)
        print(name, round(statistics.median(ts) * 1e3, 2), "ms", flush=True)
