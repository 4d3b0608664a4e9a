"""StepTimeline: a bounded ring of the latest host and device spans, always on, read by other threads.

The engine fills it (through the Tracer) on every step; the server's engine view only reads
it. Adding a span is a tuple append under a lock (about a microsecond); the ring keeps the
newest `capacity` spans and drops the oldest, so memory stays fixed however long it runs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

HOST_LANE, DEVICE_LANE = 1, 2
_ORDER_SLACK_S = 1.0
"""Spans are appended as they end, so the ring is sorted by end time up to the moment between a
thread reading the clock and taking the lock (microseconds); a reader walking back from the newest
stops once spans ended this much earlier than asked."""


class Span(NamedTuple):
    """One timed piece of a step: on the host lane schedule / prepare / commit, on the device
    lane forward+sample. Times are seconds on the timeline's clock (see StepTimeline.now)."""

    name: str
    lane: int
    start: float
    end: float
    step: int | None
    num_seqs: int
    """Sequences in the step (its batch size); 0 where the span does not know it."""
    num_tokens: int
    """Tokens the step computes (a multi-step plan's: over all its steps); 0 where the span does not know it."""
    num_sampled: int
    """Tokens the step samples (one per sequence that reaches the end of its known tokens, per step)."""
    num_steps: int = 1
    """Decode steps the span ran back to back (StepPlan.num_steps)."""


class StepTimeline:
    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"StepTimeline capacity must be at least 1, got {capacity}")
        self.origin = time.perf_counter()
        self._spans: deque[Span] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def now(self) -> float:
        """Seconds since the timeline was created (the clock every Span uses)."""
        return time.perf_counter() - self.origin

    def add(
        self,
        name: str,
        lane: int,
        start: float,
        end: float,
        step: int | None = None,
        num_seqs: int = 0,
        num_tokens: int = 0,
        num_sampled: int = 0,
        num_steps: int = 1,
    ) -> None:
        """Record a span given in time.perf_counter() seconds."""
        span = Span(
            name, lane, start - self.origin, end - self.origin, step, num_seqs, num_tokens, num_sampled, num_steps
        )
        with self._lock:
            self._spans.append(span)

    def since(self, t: float) -> list[Span]:
        """Spans that ended after time `t` (timeline clock), oldest first. Thread-safe; the cost
        grows with the spans returned, not with the ring's size."""
        found: list[Span] = []
        with self._lock:
            for span in reversed(self._spans):
                if span.end > t:
                    found.append(span)
                elif span.end < t - _ORDER_SLACK_S:
                    break
        found.reverse()
        return found
