"""CudaStreamsExecutor: depth 2; the device runs step N while the host works on N±1.

    host   | schedule N+1 | prepare N+1 | wait N | commit N | schedule N+2 | ...
    device | ------- forward N ------- | --- forward N+1 --- | ...

The host launches on a compute stream after the copy stream's host-to-device event;
sampled ids come back on a third stream into pinned memory, and the host blocks only on
the step's event in `wait`. A continuing request's next input is a placeholder filled on
the device from the previous step's sampled ids (see ModelRunner.prepare / forward).

A step with grammar masks is launched only once the engine has filled them (launching runs
the forward's Python on this thread, which would otherwise wait for masks it has to fill):
at the next `submit` or at its `wait`, whichever comes first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.core.plan import StepPlan, StepResult
from conveyor.model.runner import ModelRunner, StepOutput, to_result
from conveyor.model.sampler import SampleOutput
from conveyor.runtime.base import Executor, StepHandle
from conveyor.runtime.trace import DEVICE_LANE, Tracer


@dataclass
class LaunchedStep(StepHandle):
    host_output: StepOutput | None = None
    """The step's output tensors, copied into pinned memory (None until launched)."""
    fetched: Any = None  # torch.cuda.Event after the device-to-host copy
    started: Any = None
    finished: Any = None


class CudaStreamsExecutor(Executor):
    depth = 2

    def __init__(self, runner: ModelRunner, tracer: Tracer) -> None:
        super().__init__(runner, tracer)
        if not runner.info.is_cuda:
            raise ValueError(
                f"CudaStreamsExecutor drives CUDA streams, and the runner's device is {runner.info.name}; "
                f"on CPU use CpuOverlapExecutor"
            )
        self.compute_stream = runner.compute_stream
        self.d2h_stream = torch.cuda.Stream(runner.device)
        self._unlaunched: list[LaunchedStep] = []

    def submit(self, plan: StepPlan) -> LaunchedStep:
        self._launch_waiting()
        step = LaunchedStep(plan, self.prepare(plan))
        if step.grammar is not None and not step.grammar.is_set:
            self._unlaunched.append(step)
        else:
            self._launch(step)
        return step

    def _launch_waiting(self) -> None:
        for step in self._unlaunched:
            self._launch(step)
        self._unlaunched = []

    def _launch(self, step: LaunchedStep) -> None:
        step.started = torch.cuda.Event(enable_timing=True)
        step.finished = torch.cuda.Event(enable_timing=True)
        step.fetched = torch.cuda.Event()
        step.started.record(self.compute_stream)
        output = self.runner.forward(step.prepared)  # enqueued on the compute stream; returns at once
        step.finished.record(self.compute_stream)
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(step.finished)
            step.host_output = _map_output(output, self._to_pinned_host)
        step.fetched.record(self.d2h_stream)

    def _to_pinned_host(self, t: torch.Tensor) -> torch.Tensor:
        t.record_stream(self.d2h_stream)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def wait(self, handle: StepHandle) -> StepResult:
        assert isinstance(handle, LaunchedStep), "a handle of another executor"
        if handle.host_output is None:
            self._launch_waiting()
        handle.fetched.synchronize()
        busy = handle.started.elapsed_time(handle.finished) / 1000.0
        self.device_busy_s += busy
        end = time.perf_counter()
        plan = handle.plan
        self.tracer.add(
            "forward+sample",
            DEVICE_LANE,
            end - busy,
            end,
            plan.step_id,
            len(plan.seqs),
            plan.num_computed_tokens,
            plan.num_sampled,
            plan.num_steps,
        )
        assert handle.host_output is not None
        return to_result(plan, handle.host_output)


def _map_output(output: StepOutput, fn: Callable[[torch.Tensor], torch.Tensor]) -> StepOutput:
    def each(s: SampleOutput | None) -> SampleOutput | None:
        if s is None:
            return None
        return SampleOutput(
            *(None if t is None else fn(t) for t in (s.tokens, s.logprob, s.rank, s.top_ids, s.top_logprobs))  # type: ignore[arg-type]  # tokens is never None
        )

    later = None if output.later is None else [fn(t) for t in output.later]
    return StepOutput(each(output.sample), each(output.prompt), later)
