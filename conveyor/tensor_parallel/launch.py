"""Rank 0's side of tensor parallelism: spawn the N-1 workers, join the group, shard, and send each step.

    engine (rank 0)                         worker r (1..N-1), `python -m conveyor.tensor_parallel.worker`
    scheduler, block manager                 ─
    TensorParallelRunner.forward(step N):
      plan bytes ──stdin pipe──────────────► decode, prepare, forward (same collectives), sample
      forward: all-reduce / all-gather ◄───► all-reduce / all-gather        (gloo, one group)

The plan goes first, so every rank starts step N's forward together; rank 0's host turn for N+1 still
overlaps the forward (the executor around this runner is the usual sync or CPU-overlap one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from conveyor.config import EngineConfig
from conveyor.core.plan import StepPlan
from conveyor.device import DeviceInfo
from conveyor.errors import ConfigError
from conveyor.model.loader import LoadedModel
from conveyor.model.runner import ModelRunner, PreparedStep, StepOutput
from conveyor.tensor_parallel.group import TensorParallelGroup
from conveyor.tensor_parallel.plan_wire import encode_plan
from conveyor.tensor_parallel.shard import (
    check_tensor_parallel,
    kv_heads_replicated,
    shard_spec,
    shard_weights,
    vocab_range,
)
from conveyor.tensor_parallel.wire import STOP, write_frame

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
"""Longest a worker may take to load and shard the model before start-up fails with its exit status."""
STOP_TIMEOUT_S = 10.0


class TensorParallelWorkers:
    """The N-1 worker processes: their stdin pipes carry the plans; close() ends every one of them."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.plans_sent = 0
        self.plan_bytes_sent = 0
        self.plan_send_s = 0.0
        """Seconds rank 0 spent encoding and writing plans (the per-step broadcast cost)."""

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, payload: bytes) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with status "
                    f"{proc.returncode}; the engine cannot continue without it (see its log above)"
                )
            assert proc.stdin is not None
            write_frame(proc.stdin, payload)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            assert proc.stdout is not None
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"tensor-parallel worker rank {rank} exited with status {proc.returncode} "
                        f"while starting (see its log above)"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"tensor-parallel worker rank {rank} was not ready after {timeout_s:.0f} s")
                readable, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
                if readable:
                    line = proc.stdout.readline()
                    if line.strip() == b"ready":
                        break

    def close(self) -> None:
        """STOP to each worker, then wait; a worker that does not leave in time is killed."""
        for proc in self.procs:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    write_frame(proc.stdin, STOP)
                    proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: its own shard, plus sending each step's plan to the workers just before its forward."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        max_model_len: int,
        info: DeviceInfo,
        group: TensorParallelGroup,
        workers: TensorParallelWorkers,
        threads_before: int,
    ) -> None:
        super().__init__(config, loaded, max_model_len, info)
        self.model.parallel = group
        self.group = group
        self.workers = workers
        self._threads_before = threads_before
        self._plans: dict[int, bytes] = {}

    def prepare(self, plan: StepPlan, previous: StepPlan | None = None) -> PreparedStep:
        constrained = [s.request_id for s in plan.sampling_seqs if s.sampling is not None and s.sampling.constrained]
        if constrained:
            raise ConfigError(
                f"structured output (request {constrained[0]!r}) is not supported with "
                f"tensor_parallel_size={self.config.tensor_parallel_size} yet; use "
                f"tensor_parallel_size=1 for constrained requests"
            )
        start = time.perf_counter()
        self._plans[plan.step_id] = encode_plan(plan)
        self.workers.plan_send_s += time.perf_counter() - start
        return super().prepare(plan, previous)

    def forward(self, step: PreparedStep) -> StepOutput:
        payload = self._plans[step.step_id]
        start = time.perf_counter()
        self.workers.send(payload)  # raises, naming the worker, when one has died (the plan stays for a retry)
        del self._plans[step.step_id]
        self.workers.plan_send_s += time.perf_counter() - start
        self.workers.plan_bytes_sent += len(payload)
        self.workers.plans_sent += 1
        return super().forward(step)

    def close(self) -> None:
        self.workers.close()
        self.group.close()
        torch.set_num_threads(self._threads_before)


def start_tensor_parallel(
    config: EngineConfig, loaded: LoadedModel, dtype: str, max_model_len: int, info: DeviceInfo
) -> TensorParallelRunner:
    """Spawn ranks 1..N-1, join them in one gloo group, and build rank 0's runner on its shard."""
    n = config.tensor_parallel_size
    if info.device.type != "cpu":
        raise ConfigError(
            f"tensor_parallel_size={n} runs on CPU (gloo) only for now, but the device is {info.name}; "
            f"pass device='cpu'"
        )
    full = loaded.spec
    check_tensor_parallel(full, n, loaded.source)
    if kv_heads_replicated(full, n):
        logger.warning(
            "tensor parallelism: the model has %d KV heads for %d ranks; each KV head is replicated on "
            "%d ranks (KV cache memory per token is %dx what an even split would need)",
            full.num_kv_heads,
            n,
            n // full.num_kv_heads,
            n // full.num_kv_heads,
        )
    threads_before = torch.get_num_threads()
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // n)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", 0, n, True, wait_for_workers=False)
    header = {
        "config": dataclasses.asdict(config),
        "size": n,
        "host": "127.0.0.1",
        "port": store.port,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "num_threads": threads,
    }
    procs: list[subprocess.Popen[bytes]] = []
    workers = TensorParallelWorkers(procs)
    try:
        for rank in range(1, n):
            proc = subprocess.Popen(
                [sys.executable, "-m", "conveyor.tensor_parallel.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            procs.append(proc)
            assert proc.stdin is not None
            write_frame(proc.stdin, json.dumps({**header, "rank": rank}).encode())
        start, end = vocab_range(full, 0, n)
        group = TensorParallelGroup(store, 0, n, start, end)
        loaded.weights = shard_weights(full, loaded.weights, 0, n)
        loaded.spec = shard_spec(full, n)
        runner = TensorParallelRunner(config, loaded, max_model_len, info, group, workers, threads_before)
        plan = runner.cache_plan
        workers.send(json.dumps({"kv_cache_bytes": plan.num_blocks * plan.bytes_per_block}).encode())
        workers.wait_ready()
    except BaseException:
        workers.close()
        torch.set_num_threads(threads_before)
        raise
    logger.info("tensor parallelism: %d ranks (worker pids %s), %d threads each", n, workers.pids, threads)
    return runner
