"""TensorParallelExecutor: the executor contract over a tensor-parallel runner (conveyor/tensor_parallel).

The device work of a step is spread over N processes, but the engine sees one executor: this one wraps the
executor the device would use anyway (sync, or the CPU host-thread overlap, so rank 0's host turn for step
N+1 still runs while every rank computes step N); its runner sends each plan to the workers at the start of
the step's forward. close() ends the inner executor, then every worker process.
"""

from __future__ import annotations

from conveyor.core.plan import StepPlan, StepResult
from conveyor.runtime.base import Executor, StepHandle, ThreadLending
from conveyor.tensor_parallel.launch import TensorParallelRunner


class TensorParallelExecutor(Executor):
    runner: TensorParallelRunner  # rank 0's runner, which also ends the workers (close)

    def __init__(self, inner: Executor, runner: TensorParallelRunner) -> None:
        self.inner = inner
        self.runner = runner
        self.tracer = inner.tracer
        self.depth = inner.depth
        self._closed = False

    @property
    def device_busy_s(self) -> float:  # type: ignore[override]  # read-only here: the inner executor's
        return self.inner.device_busy_s

    def submit(self, plan: StepPlan) -> StepHandle:
        return self.inner.submit(plan)

    def wait(self, handle: StepHandle) -> StepResult:
        return self.inner.wait(handle)

    @property
    def thread_lending(self) -> ThreadLending | None:
        return self.inner.thread_lending

    def close(self) -> None:
        self.inner.close()
        if not self._closed:
            self._closed = True
            self.runner.close()
