"""PipelinedExecutor (CUDA): depth-2 pipeline; the device runs step N while the host works on N±1.

    host   | schedule N+1 | prepare N+1 | wait N | commit N | schedule N+2 | ...
    device | ------- forward N ------- | --- forward N+1 --- | ...

The host launches on a compute stream after the copy stream's host-to-device event;
sampled ids come back on a third stream into pinned memory, and the host blocks only on
the previous step's event. A continuing request's next input is a placeholder filled on
the device from the previous step's sampled ids (see ModelRunner.prepare / forward).
CPU overlap lives in runtime/overlap.py (there the host work moves to a thread instead).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from conveyor.core.plan import StepPlan, StepResult
from conveyor.model.runner import ModelRunner, PreparedStep, StepOutput, to_result
from conveyor.model.sampler import SampleOutput
from conveyor.runtime.base import Executor
from conveyor.runtime.trace import DEVICE_LANE, Tracer


@dataclass
class InflightStep:
    plan: StepPlan
    host_output: StepOutput | None = None  # CUDA: the step's output tensors, copied into pinned memory
    fetched: Any = None  # CUDA: event after the device-to-host copy
    started: Any = None
    finished: Any = None


class PipelinedExecutor(Executor):
    pipelined = True

    def __init__(self, runner: ModelRunner, tracer: Tracer) -> None:
        super().__init__(runner, tracer)
        self._last_plan: StepPlan | None = None
        if not runner.info.is_cuda:
            raise ValueError("PipelinedExecutor drives CUDA streams; on CPU use HostOverlapExecutor")
        self.compute_stream = runner.compute_stream
        self.d2h_stream = torch.cuda.Stream(runner.device)

    def submit(self, plan: StepPlan, before_launch: Callable[[PreparedStep], None] | None = None) -> InflightStep:
        """`before_launch` completes the prepared step on the host (grammar masks) before it is launched."""
        with self.tracer.span("prepare", step=plan.step_id):
            prepared = self.runner.prepare(plan, self._last_plan)
        if before_launch is not None:
            before_launch(prepared)
        self._last_plan = plan
        return self._launch_cuda(prepared, plan)

    def _launch_cuda(self, prepared: Any, plan: StepPlan) -> InflightStep:
        step = InflightStep(plan, started=torch.cuda.Event(enable_timing=True),
                            finished=torch.cuda.Event(enable_timing=True), fetched=torch.cuda.Event())
        step.started.record(self.compute_stream)
        output = self.runner.forward(prepared)  # enqueued on the compute stream; returns at once
        step.finished.record(self.compute_stream)
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(step.finished)
            step.host_output = _map_output(output, self._to_pinned_host)
        step.fetched.record(self.d2h_stream)
        return step

    def _to_pinned_host(self, t: torch.Tensor) -> torch.Tensor:
        t.record_stream(self.d2h_stream)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def wait(self, step: InflightStep) -> StepResult:
        step.fetched.synchronize()
        busy = step.started.elapsed_time(step.finished) / 1000.0
        self.device_busy_s += busy
        end = time.perf_counter()
        plan = step.plan
        self.tracer.add("forward+sample", DEVICE_LANE, end - busy, end, plan.step_id, len(plan.seqs), plan.num_tokens,
                        len(plan.sampling_seqs))
        assert step.host_output is not None
        return to_result(step.plan, step.host_output)

    def close(self) -> None:
        pass


def _map_output(output: StepOutput, fn: Callable[[torch.Tensor], torch.Tensor]) -> StepOutput:
    def each(s: SampleOutput | None) -> SampleOutput | None:
        if s is None:
            return None
        return SampleOutput(*(None if t is None else fn(t) for t in (s.tokens, s.logprob, s.rank, s.top_ids,
                                                                      s.top_logprobs)))  # type: ignore[arg-type]
    return StepOutput(each(output.sample), each(output.prompt))
