"""Decode-step efficiency: the FLOP/s a decode step achieves, as a share of the measured matmul peak.

FLOPs are counted from the model's shape (what the step must compute, not what the kernels do):
every linear layer costs 2 x rows x in x out, the LM head runs once per sequence, and attention
costs 4 x heads x head_dim x context per sequence and layer (QK^T and PV).

Two peaks are measured in the same run, both as the best square matmul:
- the float32 matmul peak, the machine's reference;
- the peak in the step's own dtype (for bfloat16 on a CPU with AMX, several times the float32 one).
A step is reported against both, so a dtype change cannot hide behind a change of yardstick.

A step with few rows is bound by memory, not arithmetic: it must stream every weight once. So the
same run also measures the copy bandwidth (bytes copied per second by one large torch copy, all
threads) and reports the step against weight bytes / that bandwidth ("bandwidth_bound_ms").
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.model.model_spec import ModelSpec
from conveyor.params import SamplingParams
from conveyor.runtime.timeline import HOST_LANE, Span


def linear_flops_per_token(spec: ModelSpec) -> int:
    """2 x (multiply-adds of every decoder linear layer + the LM head) for one token."""
    layer = (
        spec.hidden_size * (spec.q_size + 2 * spec.kv_size)
        + spec.q_size * spec.hidden_size
        + 3 * spec.hidden_size * spec.intermediate_size
    )
    return 2 * (spec.num_layers * layer + spec.hidden_size * spec.vocab_size)


def attention_flops(spec: ModelSpec, context_len: int) -> int:
    """QK^T and PV of one decode token over context_len keys, all layers."""
    return 4 * spec.num_layers * spec.num_heads * spec.head_dim * context_len


def matmul_peak_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5, min_seconds: float = 0.05) -> float:
    """Best of `repeats` square matmuls on the CPU: the ceiling a decode step is measured against. The matrices
    grow from 256 rows, doubling up to `size`, until one product takes `min_seconds`: a dtype this CPU computes
    slowly (bfloat16 without AVX-512 BF16) is measured on smaller matrices instead of for minutes."""
    n = 256
    while True:
        a = torch.randn(n, n).to(dtype)  # [n, n]
        b = torch.randn(n, n).to(dtype)  # [n, n]
        a @ b  # warm-up (oneDNN primitive creation)
        start = time.perf_counter()
        a @ b
        if n >= size or time.perf_counter() - start >= min_seconds:
            break
        n *= 2
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def weight_bytes_per_step(spec: ModelSpec, element_size: int) -> int:
    """Bytes of the weights one decode step streams: every decoder linear layer and the LM head, in the compute
    dtype (the embedding rows a step looks up are left out)."""
    return linear_flops_per_token(spec) // 2 * element_size


def copy_bandwidth_gbs(nbytes: int = 2**30, repeats: int = 5) -> float:
    """Best of `repeats` copies of `nbytes` between two float32 tensors with torch's threads, in GB/s of bytes
    copied (each byte is read once and written once)."""
    src = torch.ones(nbytes // 4)  # [nbytes / 4]
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: the destination's pages are faulted in once
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def timed_decode_steps(engine: Any, prompts: list[list[int]], params: list[SamplingParams], steps: int) -> list[float]:
    """Admit one request per prompt, step until every one has its first token (prefills done), then time
    `steps` engine steps (seconds each); the requests are aborted and the engine drained afterwards."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    decoding: set[str] = set()
    while len(decoding) < len(ids):
        decoding.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    step_seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - start)
    engine.abort(ids)
    engine.drain()
    return step_seconds


HOST_SPANS = ("schedule", "prepare", "commit")
"""The host's share of a step: plan, tensors from the plan, results into requests (the forward excluded)."""


def host_ms_per_step(spans: list[Span], steps: int) -> dict[str, float]:
    """Median milliseconds of each host part over the last `steps` of its spans (the timed decode steps)."""
    parts: dict[str, list[float]] = {name: [] for name in HOST_SPANS}
    for span in spans:
        if span.lane == HOST_LANE and span.name in parts:
            parts[span.name].append((span.end - span.start) * 1e3)
    return {name: statistics.median(ms[-steps:]) if ms else 0.0 for name, ms in parts.items()}


def measure_decode_step(
    config: EngineConfig, num_seqs: int, prompt_len: int, steps: int, repetition_penalty: float = 1.0
) -> dict[str, Any]:
    """Admit num_seqs requests, run until every one is decoding, then time `steps` engine steps."""
    from conveyor.engine.engine import Engine

    engine = Engine(config)
    spec = engine.spec
    prompts = random_workload(num_seqs, (prompt_len, prompt_len), (1, 1), spec.vocab_size).prompts
    prefill_steps = -(-num_seqs * prompt_len // config.max_num_batched_tokens)  # the first rows decode meanwhile
    params = SamplingParams(
        max_tokens=prefill_steps + steps + 8, temperature=0.0, ignore_eos=True, repetition_penalty=repetition_penalty
    )  # none ends before the timed steps do
    since = engine.timeline.now()
    step_seconds = timed_decode_steps(engine, prompts, [params] * num_seqs, steps)
    host_ms = host_ms_per_step(engine.timeline.since(since), steps)
    async_batching, dtype_name = engine.async_batching, engine.dtype
    engine.close()
    step = statistics.median(step_seconds)
    context = prompt_len + 1 + steps // 2  # median context over the timed steps
    linear = linear_flops_per_token(spec) * num_seqs
    total = linear + attention_flops(spec, context) * num_seqs
    bandwidth = copy_bandwidth_gbs()
    weight_bytes = weight_bytes_per_step(spec, torch.empty((), dtype=getattr(torch, dtype_name)).element_size())
    bound = weight_bytes / bandwidth / 1e9 if config.quantization is None else None
    peak = matmul_peak_gflops(getattr(torch, dtype_name))
    float32_peak = peak if dtype_name == "float32" else matmul_peak_gflops(torch.float32)
    return {
        "num_seqs": num_seqs,
        "prompt_len": prompt_len,
        "steps": steps,
        "repetition_penalty": repetition_penalty,
        "dtype": dtype_name,
        "quantization": config.quantization,
        "async_batching": async_batching,
        "step_ms_median": step * 1e3,
        "step_ms_all": [s * 1e3 for s in step_seconds],
        "output_tokens_per_s": num_seqs / step,
        "host_ms_per_step": sum(host_ms.values()),
        "host_ms_per_step_parts": host_ms,
        "gflop_per_step": total / 1e9,
        "achieved_gflops": total / step / 1e9,
        "achieved_linear_gflops": linear / step / 1e9,
        "matmul_peak_gflops": peak,
        "share_of_peak": total / step / 1e9 / peak,
        "float32_matmul_peak_gflops": float32_peak,
        "share_of_float32_peak": total / step / 1e9 / float32_peak,
        "weight_bytes_per_step": weight_bytes,
        "copy_bandwidth_gbs": bandwidth,
        "bandwidth_bound_ms": bound * 1e3 if bound is not None else None,
        "step_over_bandwidth_bound": step / bound if bound is not None else None,
    }
