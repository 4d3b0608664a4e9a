"""Is oneDNN's bfloat16 product short of the memory bound at a few rows? A/B over the linear layers of a
Llama-3.2-1B-shaped model (16 x qkv, o, gate/up, down, and the 49152-row LM head; random weights, 2.15 GB):

- "packed":   oneDNN over the weights packed once at load (what Conveyor runs: layers.Projection);
- "F.linear": oneDNN re-packing per call (the plain weight);
- "native":   the experimental AVX-512 BF16 GEMV in benchmarks/bf16_gemv_experiment.cpp (vdpbf16ps over W as
  stored, four weight rows streamed side by side, both threads splitting the output rows), built here.

Arms alternate in one process (best of 3 per arm and round, 3 rounds). The same run measures the copy bandwidth
(bytes copied per second, torch, all threads) and a streaming read (torch's sum); the bound is weight bytes /
copy bandwidth. The native kernel is first checked against a float32 product.

    flock /work/bench.lock .venv/bin/python benchmarks/ab_bf16_gemv.py --rows 1 2 3 4 6 8 16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

HERE = Path(__file__).resolve().parent
SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * 16 + [(49152, 2048)]  # [out, in]


def build() -> Any:
    csrc = HERE.parent / "conveyor" / "model" / "csrc"
    return load("conveyor_bf16_gemv_experiment", [str(HERE / "bf16_gemv_experiment.cpp")],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", f"-I{csrc}"],
                extra_ldflags=["-fopenmp"], verbose=False)


def best_of(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    native = build()
    torch.manual_seed(0)
    x = torch.randn(3, 2048).bfloat16()  # [rows, in]
    w = torch.randn(1000, 2048).bfloat16()  # [out, in]
    reference = x.float() @ w.float().t()  # [rows, out]
    error = (native.bf16_gemv(x, w, None).float() - reference).abs()  # [rows, out]
    allowed = reference.abs() * 2**-8 + 1e-3 * reference.abs().max()  # rounding to bfloat16 once, float32 sums
    assert bool((error <= allowed).all()), f"native GEMV differs from float32 by up to {error.max().item()}"
    weights = [torch.randn(o, i).bfloat16() for o, i in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    nbytes = sum(w.nbytes for w in weights)
    src = torch.ones(2**28)  # [2**28] float32, 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = src.nbytes / best_of(lambda: dst.copy_(src), 5)
    read = src.nbytes / best_of(lambda: src.sum(), 5)
    del src, dst
    print(f"weights {nbytes / 1e9:.3f} GB; copy {copy / 1e9:.1f} GB/s, streaming read {read / 1e9:.1f} GB/s; "
          f"bound (weights / copy) {nbytes / copy * 1e3:.0f} ms")
    for rows in args.rows:
        xs = [torch.randn(rows, w.shape[1]).bfloat16() for w in weights]
        arms: dict[str, Callable[[], object]] = {
            "packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")
                               for x, p in zip(xs, packed)],
            "F.linear": lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
            "native": lambda: [native.bf16_gemv(x, w, None) for x, w in zip(xs, weights)],
        }
        seconds: dict[str, float] = {}
        for _ in range(3):
            for name, fn in arms.items():
                fn()
                seconds[name] = min(seconds.get(name, float("inf")), best_of(fn, 3))
        cells = "  ".join(f"{k} {v * 1e3:.0f} ms ({nbytes / v / 1e9:.1f} GB/s)" for k, v in seconds.items())
        print(f"rows={rows}: {cells}  native/packed {seconds['native'] / seconds['packed']:.2f}", flush=True)


if __name__ == "__main__":
    main()
