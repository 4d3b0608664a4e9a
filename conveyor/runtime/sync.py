"""SyncExecutor: runs each plan to completion before the host continues."""

from __future__ import annotations

from conveyor.core.plan import StepPlan, StepResult
from conveyor.model.runner import ModelRunner


class SyncExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def run(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)
