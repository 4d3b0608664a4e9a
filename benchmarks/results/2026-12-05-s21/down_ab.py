"""down projections of the 1B Q4_K_M file at 64 rows, 16 layers in turn, through several kernel builds (alternating)."""
import statistics, sys, time
import conveyor  # noqa
import torch
from conveyor.model.native_build import _import, cache_root
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
builds = {n: _import(n, cache_root() / n / f"{n}.so") for n in sys.argv[1:]}
e = Engine(EngineConfig(model="/work/ckpt/llama-1b-q4_k_m.gguf", max_model_len=1024, async_batching=False))
m = e.runner.model
x = torch.randn(64, 8192).to(torch.bfloat16)
xg = torch.randn(64, 2048).to(torch.bfloat16)
res = {n: {"down": [], "gate": []} for n in builds}
for rnd in range(6):
    for n, k in builds.items():
        for what, xx in (("down", x), ("gate", xg)):
            t = time.perf_counter()
            for i in range(16):
                p = m.layers[i].down if what == "down" else m.layers[i].silu_gate.projection
                k.gguf_linear_amx_parts(xx, *p.stacked, p.in_features)
            res[n][what].append((time.perf_counter() - t) * 1e3)
for n in builds:
    print(n, {w: [round(v, 1) for v in sorted(r)] for w, r in res[n].items()})
