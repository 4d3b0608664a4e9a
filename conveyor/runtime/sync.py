"""SyncExecutor: depth 1; `submit` prepares the step, `wait` runs it to completion on the calling thread.

Running in `wait` rather than `submit` leaves the engine the moment between them to fill the
step's grammar masks, so the forward never waits for them."""

from __future__ import annotations

from conveyor.core.plan import StepPlan, StepResult
from conveyor.runtime.base import Executor, StepHandle


class SyncExecutor(Executor):
    depth = 1

    def submit(self, plan: StepPlan) -> StepHandle:
        return StepHandle(plan, self.prepare(plan))

    def wait(self, handle: StepHandle) -> StepResult:
        return self.run_here(handle.plan, handle.prepared)
