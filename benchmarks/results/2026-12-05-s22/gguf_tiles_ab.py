"""gguf_linear_tiles per type through two kernel builds, alternating in one process (512 rows x 2048 -> 2048, bf16)."""
import statistics, sys, time
sys.path.insert(0, "tests")
import conveyor  # noqa
import torch
from conveyor.model.native_build import _import, cache_root
from conveyor.model.gguf_quant import FORMATS
from test_gguf_quant import random_blocks
builds = {n: _import(n, cache_root() / n / f"{n}.so") for n in sys.argv[1:]}
x = torch.randn(512, 2048).bfloat16()
weights = {kind: random_blocks(kind, 2048, 2048, seed=1) for kind in FORMATS}
res = {n: {kind: [] for kind in FORMATS} for n in builds}
for rnd in range(5):
    for n, k in builds.items():
        for kind, w in weights.items():
            t = time.perf_counter(); k.gguf_linear_tiles(x, w.blocks, w.type_id, 2048); res[n][kind].append(time.perf_counter() - t)
for n in builds:
    print(n, {kind: round(statistics.median(v) * 1e3, 2) for kind, v in res[n].items()})
