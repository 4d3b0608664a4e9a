"""Many-rows GGUF products per projection of the real 1B Q4_K_M file (layer 0: fused Q/K Q4_K + V Q6_K, O Q4_K,
fused gate/up Q4_K, down Q6_K) at prefill sizes, against torch.matmul over the same weights dequantized to
bfloat16 (oneDNN, AMX), side by side in one process, arms alternating (their order rotated each round: the arm after another ran
slower in a fixed order); median ms per projection.

Arms: `amx` this checkout's AMX kernel as the engine calls it (a mixed-type stack in one gguf_linear_amx_parts
call), `old` another build of the kernels (--old-build: a name under $TORCH_EXTENSIONS_DIR, e.g. the starting
commit's) as that engine called it (one gguf_linear_amx per part, then torch.cat), `mm` torch.matmul(x, W^T) on
the dequantized bfloat16 weights.

    flock -w 900 /work/bench.lock timeout 300 .venv/bin/python benchmarks/ab_gguf_prefill.py --rows 512 \\
        --old-build conveyor_kernels_825da5316ef8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import gguf
import numpy as np
import torch

from conveyor.model.native import load_kernels
from conveyor.model.native_build import _import, cache_root

Matrix = tuple[torch.Tensor, int, int]  # blocks [out, row bytes], GGML type id, in_features


def medians(arms: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for rep in range(repeats + 1):  # the first round warms up
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # each arm in each place in turn
            start = time.perf_counter()
            arms[name]()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/work/ckpt/llama-1b-q4_k_m.gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--old-build", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[512])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new = load_kernels()
    if not new.gguf_amx_available():
        raise SystemExit("this CPU (or kernel) offers no AMX-BF16: nothing to measure")
    old = _import(args.old_build, cache_root() / args.old_build / f"{args.old_build}.so") if args.old_build else None
    tensors = {t.name: t for t in gguf.GGUFReader(args.model).tensors}

    def matrix(name: str) -> Matrix:
        t = tensors[name]
        blocks = torch.from_numpy(np.array(t.data).reshape(int(t.shape[1]), -1).view(np.uint8).copy())
        return blocks, int(t.tensor_type), int(t.shape[0])

    def stack(*names: str) -> list[Matrix]:  # parts of one type merged by rows, as gguf_quant.cat_rows does
        parts: list[Matrix] = []
        for m in (matrix(n) for n in names):
            if parts and parts[-1][1] == m[1]:
                parts[-1] = (torch.cat([parts[-1][0], m[0]]), m[1], m[2])
            else:
                parts.append(m)
        return parts

    layer = {"qkv": stack("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"),
             "o": stack("blk.0.attn_output.weight"),
             "gate_up": stack("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"),
             "down": stack("blk.0.ffn_down.weight")}
    report: dict[str, Any] = {"threads": args.threads, "types": {k: [p[1] for p in v] for k, v in layer.items()}}
    for rows in args.rows:
        for name, parts in layer.items():
            in_features = parts[0][2]
            dense = torch.cat([new.gguf_dequantize(b, kind, k) for b, kind, k in parts]).bfloat16()  # [out, in]
            x = torch.randn(rows, in_features).bfloat16()  # [rows, in]
            blocks, kinds = [p[0] for p in parts], [p[1] for p in parts]
            arms: dict[str, Callable[[], Any]] = {
                "amx": lambda: new.gguf_linear_amx_parts(x, blocks, kinds, in_features),
                "mm": lambda: torch.matmul(x, dense.t())}
            if old is not None:
                arms["old"] = lambda: torch.cat([old.gguf_linear_amx(x, *p) for p in parts], dim=-1)
            got = medians(arms, args.repeats)
            ratios = {f"mm/{arm}": round(got["mm"] / got[arm], 2) for arm in got if arm != "mm"}
            report[f"{name} M={rows}"] = got | ratios
            print(f"{name} M={rows}: {got} {ratios}", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
