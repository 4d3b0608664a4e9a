"""Where a 1B W1 step's time goes, by native kernel: the first step (2048 prompt tokens) and five 64-row decode steps
of W1 (64 requests, 32-128-token prompts, 32 new tokens) on the synchronous engine, every native call timed (GGUF
products keyed by their output rows x input columns and types). Session s18's probe; run it from a checkout's root
with PYTHONPATH set to that checkout, so that base and main can alternate (measure.sh steps):

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-12-03-s18/step_kernels_probe.py /work/ckpt/llama-1b-q4_k_m.gguf
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any, Callable

import conveyor  # noqa: F401  (sets the OpenMP spin count before torch loads)
import torch

from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine

seconds: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()


class Timed:
    """The native kernels with every call timed under its name (GGUF products also by shape and types)."""

    def __init__(self, kernels: object) -> None:
        self._kernels = kernels

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._kernels, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            key = name
            if name == "gguf_linear_amx_parts":
                key = f"{name} {sum(b.shape[0] for b in args[1])}x{args[3]} types {list(args[2])}"
            start = time.perf_counter()
            out = value(*args, **kwargs)
            seconds[key] += time.perf_counter() - start
            calls[key] += 1
            return out
        return call


def wrap(obj: object, seen: set[int], depth: int = 0) -> None:
    """Every `kernels` attribute reachable from obj (the model, its layers and projections) replaced by Timed."""
    if id(obj) in seen or depth > 4 or not hasattr(obj, "__dict__"):
        return
    seen.add(id(obj))
    for attr, value in list(vars(obj).items()):
        if attr == "kernels" and value is not None and not isinstance(value, Timed):
            setattr(obj, attr, Timed(value))
        elif isinstance(value, (list, tuple)):
            for item in value:
                wrap(item, seen, depth + 1)
        elif not isinstance(value, (torch.Tensor, type)):
            wrap(value, seen, depth + 1)


def report(title: str, run: Callable[[], None]) -> None:
    seconds.clear()
    calls.clear()
    start = time.perf_counter()
    run()
    print(f"{title} {(time.perf_counter() - start) * 1e3:.0f} ms")
    for key, total in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {key:44s} {total * 1e3:8.1f} ms  {calls[key]} calls")


def main() -> None:
    engine = Engine(EngineConfig(model=sys.argv[1], async_batching=False, max_model_len=1024))
    model = engine.runner.model
    wrap(model, set())
    if model.ops.decode_attention is not None and isinstance(model.ops.kernels, Timed):
        model.ops.decode_attention = model.ops.kernels.decode_attention
    workload = random_workload(64, (32, 128), (32, 32), engine.spec.vocab_size, seed=0)
    for prompt, params in zip(workload.prompts, workload.params):
        engine.add_request(prompt, params)
    report("first step", engine.step)
    for _ in range(6):
        engine.step()

    def five() -> None:
        for _ in range(5):
            engine.step()
    report("five decode steps", five)
    while engine.has_work():
        engine.step()
    engine.close()


if __name__ == "__main__":
    main()
