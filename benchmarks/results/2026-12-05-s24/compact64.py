"""The default model's products at 64 rows: compact GGUF (its Q4_1 etc.) against the dequantized bfloat16 path,
30 layers in turn, ms per step per op kind."""
import statistics, time, sys
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
res = {}
for mode in ("compact", "dequantize"):
    e = Engine(EngineConfig(async_batching=False, gguf_weights=mode))
    m = e.runner.model
    x = torch.randn(rows, 576).to(torch.bfloat16)
    xi = torch.randn(rows, 1536).to(torch.bfloat16)
    ops = {
        "qkv": lambda l: l.qkv(x),
        "o": lambda l: l.o_proj(x),
        "gate_up": lambda l: l.silu_gate(x),
        "down": lambda l: l.down(xi),
    }
    if mode == "compact":
        l0 = m.layers[0]
        print("types:", {k: getattr(getattr(l0, a), "kind", type(getattr(l0, a)).__name__) for k, a in (("qkv", "qkv"), ("o", "o_proj"), ("gate_up", "silu_gate"), ("down", "down"))}, type(m.lm_head).__name__)
    for name, fn in ops.items():
        ts = []
        for r in range(7):
            t0 = time.perf_counter()
            for l in m.layers:
                fn(l)
            ts.append(time.perf_counter() - t0)
        res[(mode, name)] = statistics.median(ts) * 1e3
    ts = []
    for r in range(7):
        t0 = time.perf_counter(); m.lm_head(x); ts.append(time.perf_counter() - t0)
    res[(mode, "lm_head")] = statistics.median(ts) * 1e3
    del e, m
for name in ("qkv", "o", "gate_up", "down", "lm_head"):
    print(f"{name:8s} compact {res[('compact', name)]:6.2f} ms   bf16 {res[('dequantize', name)]:6.2f} ms")
print("total compact %.2f bf16 %.2f" % (sum(v for (m, n), v in res.items() if m == 'compact'), sum(v for (m, n), v in res.items() if m == 'dequantize')))
