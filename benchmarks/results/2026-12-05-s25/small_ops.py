"""Per-call time of a 64-row decode step's small ops (add_rms_norm, rotary_and_cache), 30 layers' worth in turn."""
import os, statistics, time
import conveyor  # noqa
import torch
from conveyor.model.native import load_kernels
k = load_kernels()
torch.set_num_threads(int(os.environ.get("T", "2")))
torch.manual_seed(0)
L, n, hid, heads, kvh, d, bs = 30, 64, 576, 9, 3, 64, 16
blocks = 64 * 14 + 8
hs = [torch.randn(n, hid).to(torch.bfloat16) for _ in range(L)]
ds = [torch.randn(n, hid).to(torch.bfloat16) for _ in range(L)]
ws = [torch.randn(hid).to(torch.bfloat16) for _ in range(L)]
qkvs = [torch.randn(n, (heads + 2 * kvh) * d).to(torch.bfloat16) for _ in range(L)]
caches = [(torch.zeros(blocks, bs, kvh, d, dtype=torch.bfloat16), torch.zeros(blocks, bs, kvh, d, dtype=torch.bfloat16)) for _ in range(L)]
cos = torch.randn(n, d).to(torch.bfloat16); sin = torch.randn(n, d).to(torch.bfloat16)
perm = torch.randperm(blocks)[:n]
slots = (perm * bs + 5).to(torch.int64)
def norms():
    for i in range(L):
        k.add_rms_norm(hs[i], ds[i], ws[i], 1e-5)
def rot():
    for i in range(L):
        k.rotary_and_cache(qkvs[i], cos, sin, caches[i][0], caches[i][1], slots, heads, kvh)
def flush():
    big = torch.empty(64 << 20, dtype=torch.uint8); big.fill_(1)
for name, fn in (("add_rms_norm", norms), ("rotary_and_cache", rot)):
    hot, cold = [], []
    for r in range(20):
        t0 = time.perf_counter(); fn(); hot.append(time.perf_counter() - t0)
    for r in range(10):
        flush(); t0 = time.perf_counter(); fn(); cold.append(time.perf_counter() - t0)
    print(f"{name:18s} per call hot {statistics.median(hot)/L*1e6:6.1f} us, after a 64 MB sweep {statistics.median(cold)/L*1e6:6.1f} us")
