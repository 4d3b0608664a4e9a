"""The LM head at 64 rows, cold (after a 400 MB write): bf16 packed + fused argmax against the kept-compact Q8_0
head (logits written, then argmax)."""
import time, statistics, sys
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
flush = torch.empty(400 << 20, dtype=torch.uint8)
x = torch.randn(64, 576).bfloat16()
res = {}
for mode in ("dequantize", "compact"):
    e = Engine(EngineConfig(async_batching=False, gguf_weights=mode))
    m = e.runner.model
    print(mode, type(m.lm_head).__name__, getattr(m.lm_head, "computes_argmax", None), flush=True)
    f = (lambda: m.greedy_tokens(x)) if mode == "dequantize" else (lambda: m.lm_head(x))
    for _ in range(3): f()
    ts = []
    for _ in range(15):
        flush.fill_(1)
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    print(mode, f"{statistics.median(ts) * 1e3:.2f} ms cold", flush=True)
    del e, m
