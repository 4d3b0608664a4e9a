"""The default model's bf16 products (30 layers in turn, as a step makes them) at given row counts, ms per step per op.

    products.py ROWS[,ROWS...] [REPEATS]
"""
import sys, time, statistics
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
rows_list = [int(r) for r in sys.argv[1].split(",")]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
e = Engine(EngineConfig(async_batching=False))
m = e.runner.model
out = []
for rows in rows_list:
    x = torch.randn(rows, 576).to(torch.bfloat16)
    xi = torch.randn(rows, 1536).to(torch.bfloat16)
    ops = {"qkv": lambda l: l.qkv(x), "o": lambda l: l.o_proj(x), "gate_up": lambda l: l.silu_gate(x), "down": lambda l: l.down(xi)}
    tot = 0
    line = f"rows {rows:5d}:"
    for name, fn in ops.items():
        ts = []
        for r in range(reps):
            t0 = time.perf_counter()
            for l in m.layers: fn(l)
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts) * 1e3; tot += med
        line += f" {name} {med:7.2f}"
    flops = 2 * rows * 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    line += f"  total {tot:7.2f} ms  {flops / tot / 1e9:5.2f} TFLOP/s"
    print(line, flush=True)
