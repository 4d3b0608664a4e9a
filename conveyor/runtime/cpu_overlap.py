"""CpuOverlapExecutor: async batching on CPU, depth 2. The forward runs on the engine's own thread
while the engine's host turn (commit N-1, schedule and prepare N+1) runs on a host thread.

    engine thread | ---------- forward + sample N ---------- | forward N+1 ...
    host thread   | commit N-1 | schedule N+1 | prepare N+1 |

`submit` (host thread) prepares a step and queues it; `serve` (engine thread) runs the queued
forwards in order; `wait` (host thread) blocks until the engine thread has run the step.

Why this way round: torch's CPU kernels run on an OpenMP thread team owned by the thread that
calls them. The thread that loaded the model already owns one; a second thread running ops
creates a second team, and on a small machine the two teams' spinning threads fight for the
cores. So every large tensor op stays on one thread, and the host thread only runs Python and
builds small tensors from lists (docs/usage.md, "Asynchronous batching", gives the measurement).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.plan import StepPlan, StepResult
from conveyor.model.runner import ModelRunner
from conveyor.runtime.base import Executor, StepHandle, ThreadLending
from conveyor.runtime.trace import Tracer


@dataclass
class QueuedStep(StepHandle):
    result: Future[StepResult] = field(default_factory=Future)
    wanted: bool = False
    """The host thread waits for this step: run it in this turn even if it was queued during it."""


class CpuOverlapExecutor(Executor, ThreadLending):
    depth = 2

    def __init__(self, runner: ModelRunner, tracer: Tracer) -> None:
        super().__init__(runner, tracer)
        self._queue: deque[QueuedStep] = deque()
        self._changed = threading.Condition()

    @property
    def thread_lending(self) -> ThreadLending:
        return self

    def submit(self, plan: StepPlan) -> QueuedStep:
        handle = QueuedStep(plan, self.prepare(plan))
        with self._changed:
            self._queue.append(handle)
            self._changed.notify_all()
        return handle

    def wait(self, handle: StepHandle) -> StepResult:
        assert isinstance(handle, QueuedStep), "a handle of another executor"
        with self._changed:
            handle.wanted = True
            self._changed.notify_all()
        return handle.result.result()

    def num_queued(self) -> int:
        with self._changed:
            return len(self._queue)

    def serve(self, until: Future[Any], owed: int) -> None:
        """Run forwards on this thread, oldest first: the `owed` oldest queued ones (those queued before
        the host turn began: one, in the steady state, the forward that overlaps this turn) and any the
        host thread waits for. Returns once `until` is done and those have run; steps queued during the
        turn stay queued for the next call (their grammar masks may wait for a commit of that call)."""
        until.add_done_callback(lambda _: self._wake())
        while True:
            with self._changed:
                while not (owed or (self._queue and self._queue[0].wanted) or until.done()):
                    self._changed.wait()
                if not owed and not (self._queue and self._queue[0].wanted):
                    return
                step = self._queue.popleft()
                owed = max(0, owed - 1)
            try:
                step.result.set_result(self.run_here(step.plan, step.prepared))
            except BaseException as exc:  # the host thread's wait() raises it
                step.result.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            queued, self._queue = list(self._queue), deque()
        for step in queued:
            step.result.set_exception(RuntimeError(f"step {step.plan.step_id} was never run: the executor closed"))
