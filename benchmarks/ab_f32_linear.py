"""A/B of the native float32 product (csrc/f32_linear.cpp) on workload W1, side by side in one process.

Two engines in float32 with identical settings; in arm "torch-gemm" the projections are built without
the native float32 product (torch's GEMM over W^T, the layout used before it), everything else
native in both. Runs alternate between the arms; the same prompts, greedy, EOS ignored. Prints a
JSON report with the per-run seconds, medians, the median of pair ratios, and whether the tokens
of both arms agree.

    .venv/bin/python benchmarks/ab_f32_linear.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import conveyor.model.layers as layers
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine


def _engine(native_f32: bool) -> Engine:
    original = layers._native_f32
    if not native_f32:
        layers._native_f32 = lambda weight, kernels: False
    try:
        return Engine(EngineConfig(dtype="float32"))
    finally:
        layers._native_f32 = original


def _run(engine: Engine, prompts: list[list[int]], params: list[Any]) -> tuple[float, list[list[int]]]:
    engine.blocks.reset_prefix_cache()
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return time.perf_counter() - start, [tokens[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    engines = {"native-f32": _engine(True), "torch-gemm": _engine(False)}
    workload = random_workload(64, (32, 256), (128, 128), engines["native-f32"].spec.vocab_size, seed=0)
    for engine in engines.values():  # warm-up
        _run(engine, [workload.prompts[0][:8]], [workload.params[0].clone(max_tokens=2)])
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.runs):
        for name, engine in engines.items():
            elapsed, outputs[name] = _run(engine, workload.prompts, workload.params)
            seconds[name].append(elapsed)
            print(f"{name}: {workload.num_output_tokens / elapsed:.1f} tok/s", flush=True)
    for engine in engines.values():
        engine.close()
    tok_s = {name: workload.num_output_tokens / statistics.median(s) for name, s in seconds.items()}
    pairs = [t / n for n, t in zip(seconds["native-f32"], seconds["torch-gemm"])]
    print(json.dumps({"runs_seconds": seconds, "median_output_tokens_per_s": tok_s,
                      "speedup": tok_s["native-f32"] / tok_s["torch-gemm"], "pair_ratios": pairs,
                      "median_pair_ratio": statistics.median(pairs),
                      "identical_tokens": outputs["native-f32"] == outputs["torch-gemm"]}, indent=2))


if __name__ == "__main__":
    main()
