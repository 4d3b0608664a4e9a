"""The native prefill attention (csrc/prefill_attention.cpp) against torch's causal SDPA on one prompt from scratch
of 2048 and 4096 tokens, bfloat16, the K/V in a paged cache with shuffled blocks for ours and contiguous for SDPA;
median ms, one and two threads. Session s23's measure for NATIVE_PREFILL_MAX_CONTEXT (conveyor/model/attention.py).

    flock /work/bench.lock .venv/bin/python benchmarks/results/2026-12-05-s23/prefill_attention_long.py
"""
import conveyor, torch, time, random, statistics
import torch.nn.functional as F
from conveyor.model.native import load_kernels
k = load_kernels()
def med(fn, reps):
    for _ in range(2): fn()
    ts=[]
    for _ in range(reps):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1e3
for threads in (1, 2):
    torch.set_num_threads(threads)
    for heads, kvh, d, n in ((9,3,64,2048),(9,3,64,4096),(32,8,64,2048),(32,8,64,4096),(16,4,128,4096)):
        bs=16; nb=n//bs+4
        torch.manual_seed(0)
        q=torch.randn(n,heads,d).bfloat16(); kc=torch.randn(nb,bs,kvh,d).bfloat16(); vc=torch.randn_like(kc)
        perm=list(range(nb)); random.Random(0).shuffle(perm)
        tab=perm[:n//bs]; tables=torch.tensor([tab]); spans=torch.tensor([[0,n,n]]); out=torch.empty_like(q)
        kk=kc[tab].reshape(n,kvh,d).transpose(0,1)[None]; vv=vc[tab].reshape(n,kvh,d).transpose(0,1)[None]; qq=q.transpose(0,1)[None]
        reps = 5 if n >= 4096 else 10
        a=med(lambda: F.scaled_dot_product_attention(qq,kk,vv,is_causal=True,enable_gqa=True), reps)
        b=med(lambda: k.prefill_attention(q,kc,vc,tables,spans,d**-0.5,0,out), reps)
        print(f"{threads} thr heads {heads}/{kvh} d {d} n {n}: sdpa {a:.2f} ms native {b:.2f} ms ({a/b:.2f}x)", flush=True)
