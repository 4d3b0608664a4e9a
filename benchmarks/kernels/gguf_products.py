"""How fast is each GGUF product kernel (row kernel, tile kernel) per quantized type and row count, against
bfloat16 weights?

On the linear layers of a Llama-3.2-1B-shaped model (Q, K, V fused 3072 x 2048, O 2048 x 2048, gate/up
16384 x 2048, down 2048 x 8192; random weights quantized with gguf_quant.quantize): the row kernel (int8 dot
products, AVX-512 VNNI), the tile kernel (dequantized tiles into torch's GEMM: the many-rows path on CPUs
without AMX) and bfloat16 weights in the engine's Projection. Median ms for one pass over the four layers,
the arms alternating; prints JSON.

    .venv/bin/python benchmarks/kernels/gguf_products.py --rows 1 2 4 8 16 64 --types Q4_K Q6_K Q8_0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from conveyor.model.gguf_quant import quantize
from conveyor.model.layers import Projection
from conveyor.model.native import load_kernels

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # [out, in] of one decoder layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    kernels = load_kernels()
    gen = torch.Generator().manual_seed(0)
    dense_weights = [torch.randn(out, inp, generator=gen) * 0.02 for out, inp in SHAPES]
    dense = [Projection(w.bfloat16()) for w in dense_weights]
    report: dict[str, dict[str, dict[str, float]]] = {}
    for kind in args.types:
        weights = [quantize(w, kind) for w in dense_weights]
        arms = {"rows": kernels.gguf_linear_rows, "tiles": kernels.gguf_linear_tiles}
        for rows in args.rows:
            xs = [torch.randn(rows, inp, generator=gen).bfloat16() for _, inp in SHAPES]
            times: dict[str, list[float]] = {"rows": [], "tiles": [], "bf16": []}
            for _ in range(args.repeats):
                for arm, product in arms.items():
                    start = time.perf_counter()
                    for x, w in zip(xs, weights):
                        product(x, w.blocks, w.type_id, w.in_features)
                    times[arm].append(time.perf_counter() - start)
                start = time.perf_counter()
                for x, proj in zip(xs, dense):
                    proj(x)
                times["bf16"].append(time.perf_counter() - start)
            report.setdefault(kind, {})[str(rows)] = {
                arm: round(statistics.median(t[1:]) * 1e3, 3) for arm, t in times.items()
            }
            print(kind, rows, report[kind][str(rows)], flush=True)
    print(json.dumps({"threads": torch.get_num_threads(), "ms_per_layer_pass": report}, indent=1))


if __name__ == "__main__":
    main()
