"""Session s20's kernel A/B: two builds of the native kernels (by build name, both cached) on GGUF products of random
valid blocks, arms alternating in one process, median ms per call; "same bits" compares the two builds' outputs (the
AMX products must agree; at 1 row the Q5 types moved from the float path to int8 dot products, so they differ there).

    .venv/bin/python benchmarks/results/2026-12-03-s20/kernel_ab.py BASE_BUILD MAIN_BUILD
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import conveyor  # noqa: F401  (sets the OpenMP spin count before torch loads)
import torch

from conveyor.model.native_build import _import, cache_root

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_gguf_quant import random_blocks  # noqa: E402

SHAPES = [("Q4_1", 3072, 576), ("Q4_K", 16384, 2048), ("Q6_K", 2048, 8192), ("Q8_0", 49152, 576),
          ("Q5_0", 3072, 576), ("Q5_1", 3072, 576), ("Q5_K", 16384, 2048), ("Q5_K", 2048, 8192)]


def main() -> None:
    builds = {name: _import(name, cache_root() / name / f"{name}.so") for name in sys.argv[1:3]}
    torch.set_num_threads(2)
    for kind, out, inp in SHAPES:
        weights = [random_blocks(kind, out, inp, seed=i) for i in range(max(1, (32 << 20) // (out * inp)))]
        for rows in (1, 64, 128):
            x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
            op = "gguf_linear_rows" if rows <= 4 else "gguf_linear_amx"
            outs = [getattr(m, op)(x, weights[0].blocks, weights[0].type_id, inp) for m in builds.values()]
            same = torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
            times: dict[str, list[float]] = {n: [] for n in builds}
            for _ in range(9):
                for name, m in builds.items():
                    start = time.perf_counter()
                    for w in weights:
                        getattr(m, op)(x, w.blocks, w.type_id, inp)
                    times[name].append((time.perf_counter() - start) / len(weights) * 1e3)
            arms = "  ".join(f"{n}: {statistics.median(t):.3f}" for n, t in times.items())
            print(f"{kind} {out}x{inp} rows {rows:3d} ({op}): {arms} ms; same bits {same}", flush=True)


if __name__ == "__main__":
    main()
