"""`conveyor bench tp`: what tensor parallelism costs on this box, and a model of what it costs across machines.

1. Collectives on gloo over loopback, between this process and one peer process (`python -m
   conveyor.bench.tp PORT`): all-reduce of [rows, hidden] float32 (what each layer does twice per step)
   and all-gather of [rows, vocab / 2] logits (once per step), median microseconds.
2. Decode step time of the configured model at each tensor-parallel size asked (one engine at a time,
   sizes alternated over `rounds`), with rank 0's per-step cost of encoding and sending the plan.
3. `scaling_model`: the all-reduce cost per decoded token over 10/25/100 Gb/s links for 8B and 70B
   Llama shapes (a ring all-reduce: 2 (N-1)/N of the activation bytes on the wire per all-reduce, plus a
   per-hop latency), written out in benchmarks/tp_scaling.md.
"""

from __future__ import annotations

import datetime
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from conveyor.bench.decode_step import timed_decode_steps
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.params import SamplingParams

ALLREDUCE_ROWS = (1, 8, 64, 256)
"""Decode batch sizes: one token per sequence, so an all-reduce moves [rows, hidden]."""


def _collectives(group: Any, hidden: int, vocab_shard: int, iters: int) -> dict[str, float]:
    """Run the same sequence of collectives on every rank; rank 0's median times are what it reports."""
    timings: dict[str, float] = {}
    for rows in ALLREDUCE_ROWS:
        x = torch.randn(rows, hidden)  # [rows, hidden]
        for _ in range(5):  # warm-up: gloo's first calls on a shape set up buffers
            group.allreduce([x]).wait()
        seconds = []
        for _ in range(iters):
            start = time.perf_counter()
            group.allreduce([x]).wait()
            seconds.append(time.perf_counter() - start)
        timings[f"all_reduce_{rows}x{hidden}_us"] = statistics.median(seconds) * 1e6
    for rows in (1, 64):
        logits = torch.randn(rows, vocab_shard)  # [rows, vocab / 2]
        parts = [torch.empty_like(logits) for _ in range(2)]
        seconds = []
        for _ in range(max(3, iters // 4)):
            start = time.perf_counter()
            group.allgather([parts], [logits]).wait()
            seconds.append(time.perf_counter() - start)
        timings[f"all_gather_logits_{rows}x{vocab_shard}_us"] = statistics.median(seconds) * 1e6
    return timings


def measure_collectives(hidden: int, vocab: int, iters: int = 200) -> dict[str, float]:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    peer = subprocess.Popen(
        [sys.executable, "-m", "conveyor.bench.tp", str(store.port), str(hidden), str(vocab), str(iters)]
    )
    try:
        group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=120))
        return _collectives(group, hidden, vocab // 2, iters)
    finally:
        peer.wait(timeout=120)


def measure_decode(
    config: EngineConfig, sizes: list[int], num_seqs: int, prompt_len: int, steps: int, rounds: int
) -> dict[str, Any]:
    """Median decode step per tensor-parallel size, the sizes alternated `rounds` times."""
    from conveyor.engine.engine import Engine

    per_size: dict[int, list[float]] = {n: [] for n in sizes}
    plan_us: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            engine = Engine(config.replace(tensor_parallel_size=n))
            try:
                prompts = random_workload(num_seqs, (prompt_len, prompt_len), (1, 1), engine.spec.vocab_size).prompts
                params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
                workers = getattr(engine.runner, "workers", None)
                seconds = timed_decode_steps(engine, prompts, [params] * num_seqs, steps)
                per_size[n].extend(seconds)
                if workers and workers.plans_sent:  # every step's plan, prefills included
                    plan_us[n].append(workers.plan_send_s / workers.plans_sent * 1e6)
            finally:
                engine.close()
    result: dict[str, Any] = {}
    for n in sizes:
        result[f"tp{n}_step_ms_median"] = statistics.median(per_size[n]) * 1e3
        if plan_us[n]:
            result[f"tp{n}_plan_encode_send_us_per_step"] = statistics.median(plan_us[n])
    return result


LINKS_GBPS = (10, 25, 100)
SHAPES = {"llama-8b": dict(hidden=4096, layers=32), "llama-70b": dict(hidden=8192, layers=80)}
HOP_LATENCY_US = {10: 20.0, 25: 10.0, 100: 5.0}
"""Per-message latency assumed for a kernel-TCP hop over Ethernet at each link speed, in microseconds (RDMA would
be several times less). Not taken from the loopback gloo all-reduce this benchmark times: gloo's own overhead
dominates that."""


def scaling_model(tp: int = 2, batch: int = 1, bytes_per_value: int = 2) -> list[dict[str, Any]]:
    """All-reduce cost per decode step across machines: 2 all-reduces per layer of [batch, hidden] values;
    a ring moves 2 (N-1)/N of them per rank in 2 (N-1) hops."""
    rows = []
    for name, shape in SHAPES.items():
        payload = batch * shape["hidden"] * bytes_per_value
        per_allreduce_bytes = 2 * (tp - 1) / tp * payload
        count = 2 * shape["layers"]
        for gbps in LINKS_GBPS:
            wire_us = per_allreduce_bytes * 8 / (gbps * 1e9) * 1e6
            latency_us = 2 * (tp - 1) * HOP_LATENCY_US[gbps]
            step_ms = count * (wire_us + latency_us) / 1e3
            rows.append(
                {
                    "model": name,
                    "tp": tp,
                    "batch": batch,
                    "link_gbps": gbps,
                    "all_reduces_per_step": count,
                    "bytes_per_all_reduce": int(per_allreduce_bytes),
                    "wire_us": round(wire_us, 2),
                    "latency_us": latency_us,
                    "all_reduce_ms_per_step": round(step_ms, 3),
                }
            )
    return rows


def _peer(port: int, hidden: int, vocab: int, iters: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False)
    group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=120))
    _collectives(group, hidden, vocab // 2, iters)


if __name__ == "__main__":
    _peer(*(int(a) for a in sys.argv[1:5]))
