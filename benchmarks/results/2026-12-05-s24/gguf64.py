"""1B Q4_K_M file kept compact: 64-row products over all 16 layers (as a decode step) + head, ms per step part (s21's script, copied for s24's A/B: ab_pack.sh)."""
import statistics, sys, time, os
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
rows = int(os.environ.get("ROWS", "64"))
e = Engine(EngineConfig(model="/work/ckpt/llama-1b-q4_k_m.gguf", max_model_len=1024, async_batching=False))
m = e.runner.model
torch.manual_seed(0)
def parts(i):
    L = m.layers[i]
    return {"qkv": L.qkv, "o": L.o_proj, "gate_up": L.silu_gate.projection, "down": L.down}
out = {}
for rnd in range(int(os.environ.get("ROUNDS", "3"))):
    res = {}
    for name in ("qkv", "o", "gate_up", "down"):
        inp = 8192 if name == "down" else 2048
        x = torch.randn(rows, inp).to(torch.bfloat16)
        ts = []
        for rep in range(5):
            t = time.perf_counter()
            for i in range(16):
                parts(i)[name](x)
            ts.append(time.perf_counter() - t)
        res[name] = statistics.median(ts) * 1e3
    x = torch.randn(rows, 2048).to(torch.bfloat16)
    ts = []
    for rep in range(5):
        t = time.perf_counter(); m.lm_head(x); ts.append(time.perf_counter() - t)
    res["head"] = statistics.median(ts) * 1e3
    print({k: round(v, 2) for k, v in res.items()}, "sum", round(sum(res.values()), 2), flush=True)
