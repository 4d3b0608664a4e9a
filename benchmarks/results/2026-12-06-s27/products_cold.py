"""The default model's four products per layer, 30 layers in decode order, at ROWS rows, weights cold (a 400 MB
sweep between repeats); --gguf-weights compact or dequantize. ms per step.
    products_cold.py MODE ROWS [REPEATS]"""
import sys, time, statistics
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
mode, rows = sys.argv[1], int(sys.argv[2]); reps = int(sys.argv[3]) if len(sys.argv) > 3 else 9
e = Engine(EngineConfig(async_batching=False, gguf_weights=mode))
m = e.runner.model
x = torch.randn(rows, 576).to(torch.bfloat16)
xi = torch.randn(rows, 1536).to(torch.bfloat16)
sweep = torch.ones(100 * 1024 * 1024 // 1)  # 400 MB float32
ts = []; per = {"qkv": [], "o": [], "gate_up": [], "down": []}
for r in range(reps):
    sweep.add_(1.0)
    t0 = time.perf_counter()
    for l in m.layers:
        l.qkv(x); l.o_proj(x); l.silu_gate(x); l.down(xi)
    ts.append(time.perf_counter() - t0)
print(f"{mode} rows {rows}: {statistics.median(ts)*1e3:.2f} ms (min {min(ts)*1e3:.2f})", type(m.layers[0].qkv).__name__, flush=True)
