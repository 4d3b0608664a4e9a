"""Where does W1's time go: prompt-carrying steps against pure decode steps, and each op of a step?

Every forward of one W1 run timed by kind (prefill-carrying vs pure decode), then, with --profile, one 64-row
decode step and one prefill step profiled op by op (torch.profiler; use --async-batching false so that the
forward runs on the profiled thread). Prints plain text.

    .venv/bin/python benchmarks/tools/w1_breakdown.py [--profile] [--async-batching false]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import conveyor  # noqa: F401  (sets the OpenMP spin count before torch loads)
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.model.runner import ModelRunner, PreparedStep, StepOutput


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="also profile one decode and one prefill step by op")
    parser.add_argument(
        "--profile-layers",
        action="store_true",
        help="profile the decode steps' layers kernel by kernel (the Python loop instead of the one "
        "native decode_layers call, so each kernel has its row; the W1 timing above is unchanged)",
    )
    parser.add_argument("--async-batching", default="auto")
    parser.add_argument("--model", default=None)
    parser.add_argument("--input-len", default="32:256", help="prompt lengths, LO:HI (the 1B W1: 32:128)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (the 1B W1: 32)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or int8")
    parser.add_argument("--gguf-weights", default="auto", help="auto, compact or dequantize")
    parser.add_argument("--block-size", type=int, default=None, help="KV cache block size (default: the engine's)")
    args = parser.parse_args()
    mode = {"true": True, "false": False}.get(args.async_batching, args.async_batching)
    extra = {} if args.max_model_len is None else {"max_model_len": args.max_model_len}
    if args.block_size is not None:
        extra["block_size"] = args.block_size
    engine = Engine(
        EngineConfig(
            model=args.model,
            async_batching=mode,
            kv_cache_dtype=args.kv_cache_dtype,
            gguf_weights=args.gguf_weights,
            **extra,
        )
    )
    low, high = (int(v) for v in args.input_len.split(":"))
    workload = random_workload(64, (low, high), (args.output_len, args.output_len), engine.spec.vocab_size, seed=0)
    engine.add_request(workload.prompts[0][:8], workload.params[0].clone(max_tokens=2))
    while engine.has_work():
        engine.step()

    records: list[tuple[int, int, float]] = []  # (tokens, decode rows, seconds)
    original = ModelRunner._forward

    def timed(self: ModelRunner, step: PreparedStep) -> StepOutput:
        start = time.perf_counter()
        out = original(self, step)
        if out.sample is not None:
            out.sample.tokens.tolist()  # CPU: already computed; keeps the timing honest on any device
        n = int(step.input_ids.shape[0])
        decodes = sum(int(g.block_tables.shape[0]) for g in step.batch.decode_groups) if step.batch else 0
        records.append((n, decodes, time.perf_counter() - start))
        return out

    ModelRunner._forward = timed  # type: ignore[method-assign]
    start = time.perf_counter()
    for prompt, params in zip(workload.prompts, workload.params):
        engine.add_request(prompt, params)
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - start
    ModelRunner._forward = original  # type: ignore[method-assign]

    kinds: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for n, d, s in records:
        kinds["decode-only" if n == d else "with prefill"].append((n, d, s))
    total = sum(s for _, _, s in records)
    print(
        f"W1 wall {wall:.2f} s, {64 * args.output_len / wall:.0f} output tok/s; forwards {len(records)}, {total:.2f} s "
        f"({total / wall:.0%} of wall)"
    )
    for kind, rows in kinds.items():
        secs = [s for _, _, s in rows]
        print(
            f"  {kind:13s} steps {len(rows):4d}  total {sum(secs):6.2f} s"
            f"  median {statistics.median(secs) * 1e3:7.1f} ms"
            f"  tokens {sum(n for n, _, _ in rows):6d}  decode rows {sum(d for _, d, _ in rows):6d}"
        )
    full = [s for n, d, s in records if n == d == 64]
    if full:
        print(
            f"  64-row decode steps: {len(full)}, median {statistics.median(full) * 1e3:.1f} ms, "
            f"min {min(full) * 1e3:.1f} ms"
        )
    for n, d, s in kinds["with prefill"]:
        print(f"    prefill step: {n} tokens ({d} decode rows) {s * 1e3:.1f} ms")

    if args.profile:
        profile_steps(engine, workload, decode_stack=not args.profile_layers)
    engine.close()


class _Labelled:
    """The native kernels with each call inside a torch.profiler record_function (pybind calls are no torch ops,
    so the profiler would not see them)."""

    def __init__(self, kernels: object) -> None:
        self._kernels = kernels

    def __getattr__(self, name: str) -> object:
        value = getattr(self._kernels, name)
        if not callable(value):
            return value

        def call(*args: object, **kwargs: object) -> object:
            with torch.profiler.record_function(f"native::{name}"):
                return value(*args, **kwargs)

        return call


def profile_steps(engine: Engine, workload, decode_stack: bool = True) -> None:
    from torch.profiler import ProfilerActivity, profile

    model = engine.runner.model
    if model.kernels is not None:
        labelled = _Labelled(model.kernels)
        model.ops.kernels = labelled
        model.ops.decode_attention = labelled.decode_attention
        if model.ops.prefill_attention is not None:
            model.ops.prefill_attention = labelled.prefill_attention
        for layer in model.layers:  # the projections hold their own reference to the kernels
            for part in vars(layer).values():
                for holder in (part, getattr(part, "projection", None)):  # GGUFSiluGate wraps its projection
                    if getattr(holder, "kernels", None) is model.kernels:
                        holder.kernels = labelled
        if getattr(model.lm_head, "kernels", None) is model.kernels:
            model.lm_head.kernels = labelled
        if not decode_stack:  # the decode step's layers kernel by kernel, each in the table
            model.decode_stack = None
        if model.decode_stack is not None:  # the pure-decode steps' layers in one native call
            model.decode_stack.kernels = labelled
        if engine.runner.sampling_kernels is model.kernels:
            engine.runner.sampling_kernels = labelled
    engine.reset_prefix_cache()
    for prompt, params in zip(workload.prompts, workload.params):
        engine.add_request(prompt, params)
    with profile(activities=[ProfilerActivity.CPU]) as prefill_prof:
        engine.step()  # the first step: 2048 prompt tokens
    steps = 1
    while engine.has_work() and steps < 60:
        engine.step()
        steps += 1
    with profile(activities=[ProfilerActivity.CPU]) as decode_prof:
        for _ in range(5):
            engine.step()
    for name, prof in (
        ("the first step (2048 prompt tokens)", prefill_prof),
        ("five 64-row decode steps", decode_prof),
    ):
        print(f"\n=== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    while engine.has_work():
        engine.step()


if __name__ == "__main__":
    main()
