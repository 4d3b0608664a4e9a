"""One op kind of the default model (30 layers in turn), compact GGUF or dequantized, ROWS rows, THREADS threads,
REPEATS times (for perf record): compact_op_loop.py compact|dequantize qkv|o|gate_up|down ROWS THREADS REPEATS."""
import sys, time, statistics
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
mode = sys.argv[1]; op = sys.argv[2]; rows = int(sys.argv[3]) if len(sys.argv) > 3 else 64
threads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
torch.set_num_threads(threads)
e = Engine(EngineConfig(async_batching=False, gguf_weights=mode))
m = e.runner.model
x = torch.randn(rows, 576).to(torch.bfloat16)
xi = torch.randn(rows, 1536).to(torch.bfloat16)
fns = {"qkv": lambda l: l.qkv(x), "o": lambda l: l.o_proj(x), "gate_up": lambda l: l.silu_gate(x), "down": lambda l: l.down(xi)}
fn = fns[op]
ts = []
for r in range(int(sys.argv[5]) if len(sys.argv) > 5 else 60):
    t0 = time.perf_counter()
    for l in m.layers: fn(l)
    ts.append(time.perf_counter() - t0)
print(mode, op, rows, threads, "median ms", statistics.median(ts) * 1e3)
