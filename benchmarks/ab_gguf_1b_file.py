"""The GGUF products on the real 1B Q4_K_M file's weights (layer 0: fused Q/K Q4_K + V Q6_K, O Q4_K, fused
gate/up Q4_K, down Q6_K; the tied Q6_K LM head), side by side in one process, arms alternating; median ms.

    --old-build NAME   also time another build of the kernels (a name under $TORCH_EXTENSIONS_DIR, e.g. the
                       starting commit's) on the M=1 decode products, as the engine called them there (one
                       call per part of a row stack, then torch.cat)
    --rows M ...       one layer at M activation rows: row kernel (M <= 16), tile kernel, AMX kernel (where the
                       CPU has AMX-BF16), bfloat16 weights (Projection)

    flock /work/bench.lock .venv/bin/python benchmarks/ab_gguf_1b_file.py --threads 2 \\
        --old-build conveyor_kernels_8c8d0627bd8f --rows 1 4 8 16 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import gguf
import numpy as np
import torch

from conveyor.model.layers import Projection
from conveyor.model.native import load_kernels
from conveyor.model.native_build import _import, cache_root

Matrix = tuple[torch.Tensor, int, int]  # blocks [out, row bytes], GGML type id, in_features


def medians(arms: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(repeats + 1):  # the first round warms up
        for name, run in arms.items():
            start = time.perf_counter()
            run()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/work/ckpt/llama-1b-q4_k_m.gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--old-build", default=None)
    parser.add_argument("--rows", type=int, nargs="*", default=[])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new = load_kernels()
    tensors = {t.name: t for t in gguf.GGUFReader(args.model).tensors}

    def matrix(*names: str) -> Matrix:  # row-stacked as gguf_quant.cat_rows merges matrices of one type
        parts = [tensors[n] for n in names]
        blocks = torch.cat([torch.from_numpy(np.array(t.data).reshape(int(t.shape[1]), -1).view(np.uint8).copy())
                            for t in parts])
        return blocks, int(parts[0].tensor_type), int(parts[0].shape[0])

    qk, v = matrix("blk.0.attn_q.weight", "blk.0.attn_k.weight"), matrix("blk.0.attn_v.weight")
    o, gate_up = matrix("blk.0.attn_output.weight"), matrix("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight")
    down, head = matrix("blk.0.ffn_down.weight"), matrix("token_embd.weight")
    print(f"threads {args.threads}; layer-0 types: Q/K {qk[1]}, V {v[1]}, O {o[1]}, gate/up {gate_up[1]}, "
          f"down {down[1]}, head {head[1]} (12 = Q4_K, 14 = Q6_K)")

    if args.old_build:
        old = _import(args.old_build, cache_root() / args.old_build / f"{args.old_build}.so")
        x, x_wide = torch.randn(1, qk[2]).bfloat16(), torch.randn(1, down[2]).bfloat16()  # [1, 2048], [1, 8192]

        def layer_old() -> None:
            torch.cat([old.gguf_linear_rows(x, *qk), old.gguf_linear_rows(x, *v)], dim=-1)
            for w, xi in ((o, x), (gate_up, x), (down, x_wide)):
                old.gguf_linear_rows(xi, *w)

        def layer_new() -> None:
            new.gguf_linear_rows_parts(x, [qk[0], v[0]], [qk[1], v[1]], qk[2])
            for w, xi in ((o, x), (gate_up, x), (down, x_wide)):
                new.gguf_linear_rows(xi, *w)

        got = medians({"old layer": layer_old, "new layer": layer_new,
                       "old head": lambda: old.gguf_linear_rows(x, *head),
                       "new head": lambda: new.gguf_linear_rows(x, *head)}, args.repeats)
        print("M=1, median ms:", got)
        for side in ("old", "new"):
            print(f"  {side}: products of one token (16 layers + head) = "
                  f"{16 * got[side + ' layer'] + got[side + ' head']:.1f} ms")

    layer = [qk, v, o, gate_up, down]
    dense = [Projection(new.gguf_dequantize(b, kind, k).bfloat16(), None, new) for b, kind, k in layer]
    for rows in args.rows:
        xs = [torch.randn(rows, k).bfloat16() for _, _, k in layer]  # [rows, in] each
        arms = {"rows": lambda: [new.gguf_linear_rows(xi, *w) for xi, w in zip(xs, layer)],
                "tiles": lambda: [new.gguf_linear_tiles(xi, *w) for xi, w in zip(xs, layer)],
                "bf16": lambda: [d(xi) for xi, d in zip(xs, dense)]}
        if new.gguf_amx_available():
            arms["amx"] = lambda: [new.gguf_linear_amx(xi, *w) for xi, w in zip(xs, layer)]
        if rows > 16:  # the row kernel costs ~1 ms per row and layer: not a contender here
            del arms["rows"]
        got = medians(arms, args.repeats)
        ratios = "  ".join(f"{arm} / bf16 = {got[arm] / got['bf16']:.2f}" for arm in got if arm != "bf16")
        print(f"M={rows}: one layer's products, median ms: {got}  {ratios}", flush=True)


if __name__ == "__main__":
    main()
