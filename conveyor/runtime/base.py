"""The executor contract: `submit(plan) -> StepHandle`, then `wait(handle) -> StepResult`, in order.

Every executor (synchronous, CPU overlap, CUDA streams; later a multi-process one) implements
it, and the engine drives them all with one loop (engine/engine.py):

    submit(plan N+1)        the step is prepared and started, or queued to start
    wait(handle N)          the result of the oldest step, on the host as plain lists

`depth` says how many steps the engine may hold submitted and unfinished (1: each step is
waited for before the next is planned; 2: step N+1 is planned and submitted while N runs,
its next tokens placeholders the device fills from N's samples).

A step's grammar masks (structured output) travel with it as data (`handle.grammar`): the
engine fills them once every earlier step is committed, possibly after `submit`; the step's
forward waits for them only when it reaches sampling.

Thread lending (`ThreadLending`, an executor's `thread_lending`): a capability of executors whose forward
must run on the thread that calls Engine.step (on CPU, the thread whose OpenMP team computes); the engine
then runs its host turn on a host thread meanwhile and lends the executor its own thread through
`serve(until, owed)`, where `owed` is `num_queued()` taken before the host turn began (a step the turn
submits may wait for masks that only the next turn can make, so it must not be counted). Executors
without it (synchronous, CUDA streams) return None and the engine runs its host turn itself.
"""

from __future__ import annotations

import abc
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from conveyor.core.plan import StepPlan, StepResult
from conveyor.model.runner import ModelRunner, PreparedStep
from conveyor.runtime.trace import DEVICE_LANE, Tracer
from conveyor.structured.bitmask import DeferredBitmask


@dataclass
class StepHandle:
    """A submitted step: its plan and prepared tensors; each executor keeps its own state beside."""

    plan: StepPlan
    prepared: PreparedStep

    @property
    def grammar(self) -> DeferredBitmask | None:
        """The masks this step's constrained rows wait for (None when no row is constrained)."""
        return self.prepared.grammar


class ThreadLending(abc.ABC):
    """The capability of an executor whose forward runs on the engine's own thread, lent to it by `serve`
    while the host turn runs on a host thread (see the module docstring)."""

    @abc.abstractmethod
    def num_queued(self) -> int:
        """Steps submitted whose forward has not started."""

    @abc.abstractmethod
    def serve(self, until: Future[Any], owed: int) -> None:
        """Lend the calling thread to the executor until `until` is done, running the `owed` oldest queued
        steps and any step `wait` asks for."""


class Executor(abc.ABC):
    """The contract every executor implements (submit, wait, close), with what they share: the runner they
    drive, the tracer, the device-busy clock."""

    depth = 1
    """Steps the engine may keep submitted and not yet waited for (1 or 2)."""

    def __init__(self, runner: ModelRunner, tracer: Tracer) -> None:
        self.runner = runner
        self.tracer = tracer
        self.device_busy_s = 0.0
        """Seconds the device computed; with the engine's active time it gives the idle fraction."""
        self._last_plan: StepPlan | None = None

    def prepare(self, plan: StepPlan) -> PreparedStep:
        """The plan's tensors; a placeholder token is filled from the step submitted just before it."""
        with self.tracer.span("prepare", step=plan.step_id):
            prepared = self.runner.prepare(plan, self._last_plan if self.depth > 1 else None)
        self._last_plan = plan
        return prepared

    @property
    def thread_lending(self) -> ThreadLending | None:
        """The executor's thread-lending capability when its forward runs on the engine's thread, else None."""
        return None

    @abc.abstractmethod
    def submit(self, plan: StepPlan) -> StepHandle:
        """Prepare the plan's step and start it (or queue it to start); returns its handle."""

    @abc.abstractmethod
    def wait(self, handle: StepHandle) -> StepResult:
        """The result of the oldest submitted step (handles are waited for in submission order)."""

    def close(self) -> None:  # noqa: B027 - optional hook: executors without threads of their own keep this no-op
        """Stop any thread of the executor's own (after the engine has waited for every step)."""

    def run_here(self, plan: StepPlan, prepared: PreparedStep) -> StepResult:
        """Forward + sample on this thread until the result is on the host, timed as device-busy
        and traced on the device lane (CPU, where this thread does the computing)."""
        start = time.perf_counter()
        try:
            return self.runner.fetch(plan, self.runner.forward(prepared))
        finally:
            end = time.perf_counter()
            self.device_busy_s += end - start
            self.tracer.add(
                "forward+sample",
                DEVICE_LANE,
                start,
                end,
                plan.step_id,
                len(plan.seqs),
                plan.num_computed_tokens,
                plan.num_sampled,
                plan.num_steps,
            )
