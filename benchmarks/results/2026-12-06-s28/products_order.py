"""The default model's four products at ROWS rows over 30 layers: op by op (each op's 30 layers in turn, as s25's
products.py) against layer by layer (a prompt step's order: qkv, o, gate/up, down of layer 0, then layer 1, ...),
the inputs fixed (hot); ms per step, medians of 7, three rounds."""
import statistics, sys, time
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
e = Engine(EngineConfig(async_batching=False))
m = e.runner.model
x = torch.randn(rows, 576).to(torch.bfloat16)
xi = torch.randn(rows, 1536).to(torch.bfloat16)
def by_op():
    for l in m.layers: l.qkv(x)
    for l in m.layers: l.o_proj(x)
    for l in m.layers: l.silu_gate(x)
    for l in m.layers: l.down(xi)
def by_layer():
    for l in m.layers:
        l.qkv(x); l.o_proj(x); l.silu_gate(x); l.down(xi)
def med(fn):
    fn(); ts = []
    for _ in range(7):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
for r in range(3):
    print(f"round {r}: by op {med(by_op):7.1f} ms   by layer {med(by_layer):7.1f} ms", flush=True)
e.close()
