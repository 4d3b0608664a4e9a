"""Chrome trace-event JSON (opens in Perfetto / chrome://tracing): a host lane and a device lane.

Every span also goes to the always-on StepTimeline (runtime/timeline.py), the bounded ring the
server's live engine view reads; the trace file itself is collected only while enabled."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from conveyor.runtime.timeline import DEVICE_LANE, HOST_LANE, StepTimeline

__all__ = ["DEVICE_LANE", "HOST_LANE", "Tracer"]

_LANE_NAMES = {HOST_LANE: "host (schedule, prepare, commit)", DEVICE_LANE: "device (forward, sample)"}


class Tracer:
    """Collects complete ("X") events; cheap enough to leave on for a run, off by default."""

    def __init__(self, enabled: bool = False, timeline: StepTimeline | None = None) -> None:
        self.enabled = enabled
        self.timeline = timeline if timeline is not None else StepTimeline()
        self.origin = time.perf_counter()
        self._events: list[dict[str, object]] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Begin a fresh trace (earlier events are dropped)."""
        with self._lock:
            self._events.clear()
        self.origin = time.perf_counter()
        self.enabled = True

    def add(
        self,
        name: str,
        lane: int,
        start: float,
        end: float,
        step: int | None = None,
        seqs: int = 0,
        tokens: int = 0,
        sampled: int = 0,
        steps: int = 1,
    ) -> None:
        self.timeline.add(name, lane, start, end, step, seqs, tokens, sampled, steps)
        if not self.enabled:
            return
        args = {k: v for k, v in (("seqs", seqs), ("tokens", tokens), ("sampled", sampled)) if v}
        if steps > 1:
            args["steps"] = steps
        if step is not None:
            args["step"] = step
        event = {
            "name": name,
            "ph": "X",
            "pid": 1,
            "tid": lane,
            "ts": (start - self.origin) * 1e6,
            "dur": max(0.0, end - start) * 1e6,
            "args": args,
        }
        with self._lock:
            self._events.append(event)

    @contextmanager
    def span(self, name: str, lane: int = HOST_LANE, step: int | None = None, seqs: int = 0) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, lane, start, time.perf_counter(), step, seqs)

    def save(self, path: str) -> None:
        meta = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": lane, "args": {"name": name}}
            for lane, name in _LANE_NAMES.items()
        ]
        with self._lock:
            events = meta + sorted(self._events, key=lambda e: e["ts"])  # type: ignore[arg-type,return-value]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
