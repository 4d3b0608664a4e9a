"""AsyncEngine: the engine loop on its own thread, one asyncio output stream per request.

The Engine is not thread-safe, so every call into it (add, abort, step) happens on the
engine thread; asyncio callers talk to it through a command queue and receive outputs
through per-request asyncio queues (`loop.call_soon_threadsafe`). The forward pass
releases the GIL, so HTTP handling keeps going while the device computes.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.engine.info import EngineInfo
from conveyor.engine.stats import EngineStats
from conveyor.engine.timings import StreamTimings, finished_request
from conveyor.errors import ConveyorError
from conveyor.outputs import SHUTDOWN, RequestOutput
from conveyor.params import SamplingParams
from conveyor.runtime.timeline import Span

logger = logging.getLogger(__name__)


class EngineDeadError(ConveyorError):
    """The engine loop failed; no request can be served until a restart."""


class QueueFullError(ConveyorError):
    """Too many requests are waiting; retry later."""


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    deadline: float | None
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        max_queued_requests: int = 1024,
        on_timings: Callable[[StreamTimings], None] | None = None,
    ) -> None:
        self.config = config
        self.max_queued_requests = max_queued_requests
        self._engine: Engine | None = None
        self.info: EngineInfo | None = None
        """The engine's model facts, published once it is ready (None while the model loads)."""
        self.error: str | None = None
        self._commands: queue.Queue[tuple[str, Any, Future[Any] | None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._on_timings = on_timings
        self._stats: EngineStats | None = None
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    @property
    def failed_to_start(self) -> bool:
        """The engine never became ready (the model failed to load); `error` says why."""
        return self.error is not None and not self._ready.is_set()

    @property
    def is_dead(self) -> bool:
        return self.error is not None

    async def wait_ready(self) -> None:
        # polled: both are set from the engine thread, where no asyncio.Event can be set
        while not self._ready.is_set() and self.error is None:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if self.error is not None:
            raise EngineDeadError(self.error)

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout=30)

    @property
    def num_active(self) -> int:
        with self._streams_lock:
            return len(self._streams)

    def stats(self) -> EngineStats | None:
        """The engine's counters after its latest step (None while the model loads)."""
        return self._stats

    def recent_spans(self, since: float | None = None, window_s: float = 5.0) -> tuple[float, list[Span]]:
        """The engine clock's time now and the host / device spans that ended after `since` (that
        clock), or in the last `window_s` seconds when `since` is None. Reads the engine's bounded
        timeline only, so it is safe from any thread and costs the engine nothing; (0.0, []) while
        the model loads."""
        engine = self._engine
        if engine is None or not self._ready.is_set():
            return 0.0, []
        now = engine.timeline.now()
        return now, engine.timeline.since(now - window_s if since is None else since)

    # ---- requests ---------------------------------------------------------------------
    async def submit(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str, timeout_s: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Admit a request; returns its stream of cumulative outputs (ending with the terminal
        one). Raises InvalidRequestError, QueueFullError or EngineDeadError when refused.
        Closing or cancelling the stream (client gone) aborts the request at once."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        loop = asyncio.get_running_loop()
        stream = _Stream(asyncio.Queue(), loop, None if timeout_s is None else time.perf_counter() + timeout_s, params)
        admitted: Future[str] = Future()
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._commands.put(("add", (prompt, params, request_id), admitted))
        try:
            await asyncio.wrap_future(admitted)
        except BaseException:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str, timeout_s: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """submit() and iterate in one: yields cumulative outputs until the terminal one."""
        stream = await self.submit(prompt, params, request_id, timeout_s)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def abort_all(self, reason: str) -> None:
        """End every request now, as the server does when it shuts down: each fails with `reason` and error_code
        SHUTDOWN."""
        self._commands.put(("abort_all", reason, None))

    # ---- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = Engine(self.config, output_sink=self._dispatch)  # thread-safe: streams lock + call_soon_threadsafe
            self._stats = engine.stats()
            # the server's threads tokenize with their own copy, never the engine's (see engine.py, "Threads")
            tokenizer = None if engine.info.tokenizer is None else copy.deepcopy(engine.info.tokenizer)
            self._engine, self.info = engine, dataclasses.replace(engine.info, tokenizer=tokenizer)
        except BaseException as exc:  # start-up failure: the server reports it and exits
            self.error = f"the engine failed to start: {exc}"
            logger.error("%s", self.error)
            return
        self._ready.set()
        while not self._stopping.is_set():
            try:
                self._drain_commands(block=not engine.has_work())
                self._expire_deadlines()
                if engine.has_work():
                    self._dispatch(engine.step())
                self._stats = engine.stats()
            except BaseException as exc:
                self._die(exc)
                return
        engine.close()

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any, reply: Future[Any] | None) -> None:
        engine = self._engine
        assert engine is not None
        if kind == "add":
            prompt, params, request_id = payload
            with self._streams_lock:
                alive = request_id in self._streams
            if not alive:  # the client left before admission
                if reply is not None:
                    reply.set_exception(asyncio.CancelledError())
                return
            if engine.num_waiting() >= self.max_queued_requests:
                self._fail_admission(
                    request_id,
                    reply,
                    QueueFullError(
                        f"{engine.num_waiting()} requests are already waiting (--max-queued-requests="
                        f"{self.max_queued_requests}); retry shortly"
                    ),
                )
                return
            try:
                engine.add_request(prompt, params, request_id)
            except Exception as exc:
                self._fail_admission(request_id, reply, exc)
                return
            if reply is not None:
                reply.set_result(request_id)
        elif kind == "abort":
            self._dispatch(engine.abort(payload))
        elif kind == "abort_all":
            with self._streams_lock:
                ids = list(self._streams)
            self._dispatch(engine.abort(ids, error=payload, error_code=SHUTDOWN))

    def _fail_admission(self, request_id: str, reply: Future[Any] | None, exc: BaseException) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)
        if reply is not None:
            reply.set_exception(exc)

    def _expire_deadlines(self) -> None:
        now = time.perf_counter()
        with self._streams_lock:
            expired = [rid for rid, s in self._streams.items() if s.deadline is not None and now > s.deadline]
        for rid in expired:
            assert self._engine is not None
            self._dispatch(
                self._engine.abort(
                    rid, error="the request timed out (--request-timeout); it was aborted", error_code="timeout"
                )
            )

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        timings = StreamTimings()
        for out in outputs:
            with self._streams_lock:
                stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            tokens = sum(len(c.token_ids) for c in out.outputs)
            if tokens > stream.num_tokens:
                if stream.last_token_time is None:
                    timings.ttft.append(now - stream.arrival)
                    stream.first_token_time = now
                else:
                    timings.inter_token.append(now - stream.last_token_time)
                stream.last_token_time, stream.num_tokens = now, tokens
            if out.finished:
                timings.e2e.append(now - stream.arrival)
                context = self.info.max_model_len if self.info is not None else len(out.prompt_token_ids)
                timings.finished.append(
                    finished_request(out, stream.params, stream.first_token_time, stream.last_token_time, context)
                )
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        if self._on_timings is not None and (timings.ttft or timings.inter_token or timings.e2e):
            self._on_timings(timings)

    def _die(self, exc: BaseException) -> None:
        self.error = f"the engine loop failed: {type(exc).__name__}: {exc}"
        logger.error("engine loop failed", exc_info=exc)
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDeadError(self.error))
