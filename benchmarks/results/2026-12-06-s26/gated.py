"""The default model's gated gate/up product (30 layers in turn) at ROWS rows: median ms per 30 layers over REPEATS.

    gated.py ROWS[,ROWS...] [REPEATS]
"""
import statistics
import sys
import time

import conveyor  # noqa: F401
import torch

from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine

reps = int(sys.argv[2]) if len(sys.argv) > 2 else 15
model = Engine(EngineConfig(async_batching=False)).runner.model
line = ""
for rows in (int(r) for r in sys.argv[1].split(",")):
    x = torch.randn(rows, 576).to(torch.bfloat16)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for layer in model.layers:
            layer.silu_gate(x)
        times.append(time.perf_counter() - start)
    line += f" gate_up {rows}: {statistics.median(times) * 1e3:7.2f} ms (min {min(times) * 1e3:.2f})"
print(line)
