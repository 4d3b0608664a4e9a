"""Is our AMX bfloat16 product (csrc/amx_product.cpp, weights packed in tiles) faster than oneDNN's packed product
on a model's linears?

Alternating in one process, on the default model's (135m) or the 1B's shapes. "step": every linear of the
model in order (all layers, then the LM head), as a decode step reads them (the weights streamed from L3 /
memory, each once); "alone": one matrix in a loop (its weights hot in cache). The best of --repeats
alternations of each; ratios are oneDNN's time over ours (above 1: ours faster). Needs AMX-BF16.

    .venv/bin/python benchmarks/kernels/bf16_amx_vs_onednn.py --model 135m --rows 1,4,16,64,256,2048
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from conveyor.model.layers import pack_bf16_tiles, unpack_bf16_tiles
from conveyor.model.native import load_kernels

SHAPES = {
    "135m": dict(layers=30, hidden=576, inter=1536, heads=9, kv_heads=3),
    "1b": dict(layers=16, hidden=2048, inter=8192, heads=32, kv_heads=8),
}
VOCAB, HEAD_DIM = 49152, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(SHAPES), default="135m")
    parser.add_argument("--rows", default="1,4,16,64,256,2048")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers in the step (default: the model's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-alone", action="store_true", help="only the step")
    parser.add_argument("--unpacked", action="store_true", help="also F.linear over W rebuilt from the tiles")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_kernels()
    if not kernels.bf16_amx_available():
        raise SystemExit("this CPU or build has no AMX-BF16: nothing to compare")
    s = SHAPES[args.model]
    hidden = s["hidden"]
    names = [
        ("qkv", (s["heads"] + 2 * s["kv_heads"]) * HEAD_DIM, hidden),
        ("o", hidden, s["heads"] * HEAD_DIM),
        ("gate_up", 2 * s["inter"], hidden),
        ("down", hidden, s["inter"]),
    ]
    torch.manual_seed(0)
    linears: list[tuple[str, int, int, torch.Tensor, torch.Tensor]] = []  # name, out, in, tiles, oneDNN's pack
    for _ in range(args.layers or s["layers"]):
        for name, out_features, in_features in names:
            w = (torch.randn(out_features, in_features) * 0.02).bfloat16()  # [out, in]
            linears.append(
                (name, out_features, in_features, pack_bf16_tiles(w), torch.ops.mkldnn._reorder_linear_weight(w, 64))
            )
    w = (torch.randn(VOCAB, hidden) * 0.02).bfloat16()  # [vocab, hidden]
    linears.append(("lm_head", VOCAB, hidden, pack_bf16_tiles(w), torch.ops.mkldnn._reorder_linear_weight(w, 64)))
    del w

    def ours(x: torch.Tensor, i: int) -> torch.Tensor:
        return kernels.bf16_linear_amx(x, linears[i][3], linears[i][1])

    def unpacked(x: torch.Tensor, i: int) -> torch.Tensor:  # oneDNN over W rebuilt from the tiles per call
        return torch.nn.functional.linear(x, unpack_bf16_tiles(linears[i][3], linears[i][1]))

    def onednn(x: torch.Tensor, i: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, linears[i][4], None, "none", [None], "")

    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {n: torch.randn(rows, n).bfloat16() for n in {lin[2] for lin in linears}}  # [rows, in]

        def step(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> float:
            start = time.perf_counter()
            for i, lin in enumerate(linears):
                fn(inputs[lin[2]], i)
            return time.perf_counter() - start

        variants = [("ours", ours), ("onednn", onednn)] + ([("unpacked", unpacked)] if args.unpacked else [])
        best = {key: float("inf") for key, _ in variants}
        for _ in range(args.repeats):
            for key, fn in variants:
                best[key] = min(best[key], step(fn))
        extra = f", W rebuilt per call + F.linear {best['unpacked'] * 1e3:.2f} ms" if args.unpacked else ""
        print(
            f"{args.model} rows={rows} step ({len(linears)} linears): ours {best['ours'] * 1e3:.2f} ms, "
            f"oneDNN {best['onednn'] * 1e3:.2f} ms, {best['onednn'] / best['ours']:.2f}x{extra}",
            flush=True,
        )
        if args.no_alone:
            continue
        parts = []
        for i in [*list(range(len(names))), len(linears) - 1]:
            name, out_features, in_features = linears[i][:3]
            x = inputs[in_features]
            reps = max(2, min(200, int(2e-3 * 1.2e12 / (2 * rows * out_features * in_features))))
            alone = {"ours": float("inf"), "onednn": float("inf")}
            for _ in range(3):
                for key, fn in (("ours", ours), ("onednn", onednn)):
                    fn(x, i)
                    start = time.perf_counter()
                    for _ in range(reps):
                        fn(x, i)
                    alone[key] = min(alone[key], (time.perf_counter() - start) / reps)
            parts.append(
                f"{name} {alone['ours'] * 1e6:.0f}/{alone['onednn'] * 1e6:.0f} us "
                f"({alone['onednn'] / alone['ours']:.2f}x)"
            )
        print("   alone, ours/oneDNN: " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    main()
