"""1B Q4_K_M file: 2048-row products of the 16 layers as a prompt step makes them (pack + product), and the pack alone."""
import statistics, time, os
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.model.gguf_projection import packed_tiles
rows = int(os.environ.get("ROWS", "2048"))
e = Engine(EngineConfig(model="/work/ckpt/llama-1b-q4_k_m.gguf", max_model_len=1024, async_batching=False))
m = e.runner.model
def parts(i):
    L = m.layers[i]
    return {"qkv": L.qkv, "o": L.o_proj, "gate_up": L.silu_gate, "down": L.down}
for rnd in range(int(os.environ.get("ROUNDS", "2"))):
    res, pack = {}, {}
    for name in ("qkv", "o", "gate_up", "down"):
        inp = 8192 if name == "down" else 2048
        x = torch.randn(rows, inp).to(torch.bfloat16)
        t = time.perf_counter()
        for i in range(16):
            parts(i)[name](x)
        res[name] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        for i in range(16):
            p = parts(i)[name]
            p = getattr(p, "projection", p)
            packed_tiles(m.kernels, *p.stacked, p.in_features, p.out_features, name == "gate_up")
        pack[name] = (time.perf_counter() - t) * 1e3
    print("all", {k: round(v, 1) for k, v in res.items()}, round(sum(res.values()), 1), "| pack", {k: round(v, 1) for k, v in pack.items()}, round(sum(pack.values()), 1), flush=True)
