"""SyncExecutor: runs each plan to completion before the host continues."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from conveyor.model.runner import PreparedStep

from conveyor.core.plan import StepPlan, StepResult
from conveyor.runtime.base import Executor


@dataclass
class DoneHandle:
    plan: StepPlan
    result: StepResult


class SyncExecutor(Executor):
    pipelined = False

    def submit(self, plan: StepPlan, before_run: Callable[[PreparedStep], None] | None = None) -> DoneHandle:
        """`before_run` completes the prepared step on the host (grammar masks) before it runs."""
        with self.tracer.span("prepare", step=plan.step_id):
            prepared = self.runner.prepare(plan)
        if before_run is not None:
            before_run(prepared)
        return DoneHandle(plan, self.run_here(plan, prepared))

    def wait(self, handle: DoneHandle) -> StepResult:
        return handle.result

    def close(self) -> None:
        pass
