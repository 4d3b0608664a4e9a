"""HostOverlapExecutor: async batching on CPU. The forward runs on the engine's own thread;
a host thread commits step N-1 and schedules and prepares step N+1 meanwhile.

    engine thread | ---------- forward + sample N ---------- | forward N+1 ...
    host thread   | commit N-1 | schedule N+1 | prepare N+1 |

Why this way round: torch's CPU kernels run on an OpenMP thread team owned by the thread
that calls them. The thread that loaded the model already owns one; a second thread
running ops creates a second team, and on a small machine the two teams' spinning
threads fight for the cores (measured here: batch-1 decode 29 ms/token from the loading
thread, 54 ms/token from a fresh worker thread). So every tensor op stays on one thread,
and the host thread only runs Python and builds small tensors from lists.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from conveyor.core.plan import StepPlan, StepResult
from conveyor.model.runner import ModelRunner, PreparedStep
from conveyor.runtime.base import Executor
from conveyor.runtime.trace import Tracer

T = TypeVar("T")


class HostOverlapExecutor(Executor):
    pipelined = True

    def __init__(self, runner: ModelRunner, tracer: Tracer) -> None:
        super().__init__(runner, tracer)
        self._host = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-host")

    def prepare(self, plan: StepPlan, previous: StepPlan | None) -> PreparedStep:
        with self.tracer.span("prepare", step=plan.step_id):
            return self.runner.prepare(plan, previous)

    def run_with_host(self, plan: StepPlan, prepared: PreparedStep,
                      host_work: Callable[[], T]) -> tuple[StepResult, T]:
        """Run the step here while `host_work` runs on the host thread; return both results."""
        pending = self._host.submit(host_work)
        try:
            result = self.run_here(plan, prepared)
        finally:
            host_result = pending.result()  # never leave host work running past this call
        return result, host_result

    def close(self) -> None:
        self._host.shutdown(wait=True)

