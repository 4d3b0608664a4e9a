"""LM head + greedy argmax at 64 rows, written logits + argmax_rows against the fused argmax product, caches flushed
between calls (a decode step's layers leave the head's weights out of cache). Alternating, one process."""
import statistics, sys, time
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.model.sampler import _first_argmax
extra = {} if len(sys.argv) < 2 else {"model": sys.argv[1], "max_model_len": 1024}
e = Engine(EngineConfig(async_batching=False, **extra))
m = e.runner.model
k = m.kernels
h = torch.randn(64, m.spec.hidden_size).to(torch.bfloat16)
flush = torch.ones(256 << 20, dtype=torch.uint8)
a, b = [], []
for r in range(40):
    flush.add_(1)
    t = time.perf_counter(); ref = _first_argmax(m.logits(h), k); a.append(time.perf_counter() - t)
    flush.add_(1)
    t = time.perf_counter(); got = m.greedy_tokens(h); b.append(time.perf_counter() - t)
    assert torch.equal(ref, got)
print(sys.argv[1:] or "default", f"logits + argmax {statistics.median(a)*1e3:.2f} ms, fused {statistics.median(b)*1e3:.2f} ms")
