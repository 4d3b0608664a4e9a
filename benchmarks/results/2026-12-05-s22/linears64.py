"""The default model's 30 layers' linears at 64 rows, as decode_layers calls them (weights cold: 213 MB > L3)."""
import statistics, sys, time
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
e = Engine(EngineConfig(async_batching=False))
m = e.runner.model
s = m.decode_stack
k = m.kernels
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
x = torch.randn(rows, 576).to(torch.bfloat16)
a = torch.randn(rows, 1536).to(torch.bfloat16)
xa = torch.randn(rows, 576).to(torch.bfloat16)
lm = m.lm_head
def layers():
    for i in range(30):
        k.bf16_linear_amx(x, s.qkv_tiles[i], 960)
        k.bf16_linear_amx(xa, s.o_tiles[i], 576)
        k.bf16_silu_gate_amx(x, s.gate_up_tiles[i], 1536)
        k.bf16_linear_amx(a, s.down_tiles[i], 576)
def kinds():
    out = {}
    for name, fn in (("qkv", lambda i: k.bf16_linear_amx(x, s.qkv_tiles[i], 960)),
                     ("o", lambda i: k.bf16_linear_amx(xa, s.o_tiles[i], 576)),
                     ("gate_up", lambda i: k.bf16_silu_gate_amx(x, s.gate_up_tiles[i], 1536)),
                     ("down", lambda i: k.bf16_linear_amx(a, s.down_tiles[i], 576))):
        t = time.perf_counter()
        for i in range(30):
            fn(i)
        out[name] = (time.perf_counter() - t) * 1e3
    return out
nbytes = sum(t.numel() * 2 for l in (s.qkv_tiles, s.o_tiles, s.gate_up_tiles, s.down_tiles) for t in l)
print("weights MB", nbytes / 1e6)
for threads in (2, 1):
    torch.set_num_threads(threads)
    tot = []
    per = []
    for r in range(8):
        t = time.perf_counter(); layers(); tot.append((time.perf_counter() - t) * 1e3)
        per.append(kinds())
    med = statistics.median(tot)
    print(f"threads {threads}: layers in order {sorted(round(v,2) for v in tot)} ms, {nbytes/med/1e6:.1f} GB/s")
    for name in per[0]:
        print(f"   {name}: {statistics.median(p[name] for p in per):.2f} ms")

e2 = None
for threads in (2, 1):
    torch.set_num_threads(threads)
    res = {}
    for name, fn in (("qkv", lambda i: k.bf16_linear_amx(x, s.qkv_tiles[i], 960)),
                     ("o", lambda i: k.bf16_linear_amx(xa, s.o_tiles[i], 576)),
                     ("gate_up", lambda i: k.bf16_silu_gate_amx(x, s.gate_up_tiles[i], 1536)),
                     ("down", lambda i: k.bf16_linear_amx(a, s.down_tiles[i], 576))):
        v = []
        for r in range(5):
            fn(0)
            t = time.perf_counter()
            for i in range(30):
                fn(0)
            v.append((time.perf_counter() - t) * 1e3)
        res[name] = round(statistics.median(v), 2)
    print("hot (one layer's weights 30x), threads", threads, res)
