"""What every executor shares: the runner it drives, the tracer, and the device-busy clock."""

from __future__ import annotations

import time

from conveyor.core.plan import StepPlan, StepResult
from conveyor.model.runner import ModelRunner, PreparedStep
from conveyor.runtime.trace import DEVICE_LANE, Tracer


class Executor:
    def __init__(self, runner: ModelRunner, tracer: Tracer) -> None:
        self.runner = runner
        self.tracer = tracer
        self.device_busy_s = 0.0
        """Seconds the device computed; with the engine's active time it gives the idle fraction."""

    def run_here(self, plan: StepPlan, prepared: PreparedStep) -> StepResult:
        """Forward + sample on this thread until the result is on the host, timed as device-busy
        and traced on the device lane (CPU, where this thread does the computing)."""
        start = time.perf_counter()
        try:
            return self.runner.fetch(plan, self.runner.forward(prepared))
        finally:
            end = time.perf_counter()
            self.device_busy_s += end - start
            self.tracer.add("forward+sample", DEVICE_LANE, start, end, plan.step_id, len(plan.seqs), plan.num_tokens,
                            len(plan.sampling_seqs))
