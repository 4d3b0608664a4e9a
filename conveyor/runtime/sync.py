"""SyncExecutor: runs each plan to completion before the host continues."""

from __future__ import annotations

import time
from dataclasses import dataclass

from conveyor.core.plan import StepPlan, StepResult
from conveyor.model.runner import ModelRunner
from conveyor.runtime.trace import DEVICE_LANE, Tracer


@dataclass
class DoneHandle:
    plan: StepPlan
    result: StepResult


class SyncExecutor:
    pipelined = False

    def __init__(self, runner: ModelRunner, tracer: Tracer) -> None:
        self.runner = runner
        self.tracer = tracer
        self.device_busy_s = 0.0

    def submit(self, plan: StepPlan) -> DoneHandle:
        with self.tracer.span("prepare", step=plan.step_id):
            prepared = self.runner.prepare(plan)
        start = time.perf_counter()
        result = self.runner.fetch(plan, self.runner.forward(prepared))
        end = time.perf_counter()
        self.device_busy_s += end - start
        self.tracer.add("forward+sample", DEVICE_LANE, start, end, step=plan.step_id, tokens=plan.num_tokens)
        return DoneHandle(plan, result)

    def wait(self, handle: DoneHandle) -> StepResult:
        return handle.result

    def close(self) -> None:
        pass
