import time, statistics
import conveyor  # noqa: F401  (before torch: the OpenMP spin count)
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
e = Engine(EngineConfig(async_batching=False))
m = e.runner.model
x = torch.randn(64, 576).bfloat16()
flush = torch.empty(400 << 20, dtype=torch.uint8)
for mode in ("hot", "cold", "hot", "cold"):
    ts = []
    for _ in range(15):
        if mode == "cold": flush.fill_(1)
        t = time.perf_counter(); m.greedy_tokens(x); ts.append(time.perf_counter() - t)
    print(mode, f"{statistics.median(ts) * 1e3:.2f} ms")
