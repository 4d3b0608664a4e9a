"""One op kind of the default model (bf16 packed weights, 30 layers in turn) at ROWS rows, REPEATS times, for perf
record: op_loop_2048.py qkv|o|gate_up|down ROWS REPEATS."""
import sys, time
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
e = Engine(EngineConfig(async_batching=False))
m = e.runner.model
rows = int(sys.argv[2]); op = sys.argv[1]
x = torch.randn(rows, 576).to(torch.bfloat16); xi = torch.randn(rows, 1536).to(torch.bfloat16)
fns = {"qkv": lambda l: l.qkv(x), "o": lambda l: l.o_proj(x), "gate_up": lambda l: l.silu_gate(x), "down": lambda l: l.down(xi)}
fn = fns[op]
t0 = time.perf_counter()
for r in range(int(sys.argv[3])):
    for l in m.layers: fn(l)
print(op, rows, (time.perf_counter() - t0) / int(sys.argv[3]) * 1e3, "ms per 30 layers")
