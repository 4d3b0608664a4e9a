"""A/B of the native float32 product (csrc/f32_linear.cpp), side by side in one process: workload W1,
with --decode-step the 64-sequence decode step of `conveyor bench decode-step`, or with --linears ROWS...
all decoder linear layers of the default model (random weights of its shapes) at those row counts.

Two engines in float32 with identical settings; in arm "torch-gemm" the projections are built without
the native float32 product (torch's GEMM over W^T, the layout used before it), everything else
native in both. Runs alternate between the arms; the same prompts, greedy, EOS ignored. Prints a
JSON report with the per-run seconds, medians, the median of pair ratios, and whether the tokens
of both arms agree.

    .venv/bin/python benchmarks/ab_f32_linear.py --runs 3
    .venv/bin/python benchmarks/ab_f32_linear.py --runs 3 --decode-step
    .venv/bin/python benchmarks/ab_f32_linear.py --runs 5 --linears 1 8 64 512 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import conveyor.model.layers as layers
from conveyor.bench.decode_step import measure_decode_step
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine


def _built(native_f32: bool, build: Any) -> Any:
    """build() with the projections made with or without the native float32 product."""
    original = layers._native_f32
    if not native_f32:
        layers._native_f32 = lambda weight, kernels: False
    try:
        return build()
    finally:
        layers._native_f32 = original


def _engine(native_f32: bool) -> Engine:
    return _built(native_f32, lambda: Engine(EngineConfig(dtype="float32")))


def _decode_steps(runs: int) -> None:
    results: dict[str, list[dict[str, Any]]] = {"native-f32": [], "torch-gemm": []}
    for _ in range(runs):
        for name in results:
            r = _built(name == "native-f32", lambda: measure_decode_step(EngineConfig(dtype="float32"), 64, 128, 16))
            results[name].append(r)
            print(f"{name}: {r['step_ms_median']:.1f} ms, {100 * r['share_of_peak']:.1f}% of "
                  f"{r['matmul_peak_gflops']:.0f} GFLOP/s", flush=True)
    summary = {name: {"step_ms": [r["step_ms_median"] for r in rs], "share_of_peak": [r["share_of_peak"] for r in rs],
                      "matmul_peak_gflops": [r["matmul_peak_gflops"] for r in rs]} for name, rs in results.items()}
    print(json.dumps(summary, indent=2))


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


def _linears(runs: int, row_counts: list[int]) -> None:
    engine = Engine(EngineConfig(dtype="float32"))
    shapes = [(p.out_features, p.in_features) for layer in engine.runner.model.layers
              for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    kernels = engine.runner.model.layers[0].qkv.kernels  # the native kernels its float32 projections use
    engine.close()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=gen) * 0.05 for out_features, in_features in shapes]
    arms = {"native-f32": [layers.Projection(w, None, kernels) for w in weights],
            "torch-gemm": [layers.Projection(w) for w in weights]}
    report: dict[int, dict[str, float]] = {}
    for rows in row_counts:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {in_features for _, in_features in shapes}}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(runs):
            for name, projections in arms.items():
                start = time.perf_counter()
                for p in projections:
                    p(inputs[p.in_features])
                times[name].append(time.perf_counter() - start)
        report[rows] = {f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()}
        report[rows]["speedup"] = report[rows]["torch-gemm_ms"] / report[rows]["native-f32_ms"]
        print(rows, report[rows], flush=True)
    print(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decode-step", action="store_true", help="time 64-sequence decode steps instead of W1")
    parser.add_argument("--linears", type=int, nargs="+", metavar="ROWS", help="time the decoder linears only")
    args = parser.parse_args()
    if args.linears:
        _linears(args.runs, args.linears)
        return
    if args.decode_step:
        _decode_steps(args.runs)
        return
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
