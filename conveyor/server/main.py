"""`conveyor serve`: start the engine, serve HTTP, drain on SIGTERM, exit 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
from types import FrameType
from typing import Any, Protocol

import uvicorn

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.errors import ConfigError
from conveyor.server.app import build_app
from conveyor.server.metrics import Metrics
from conveyor.server.state import ServerOptions, ServerState
from conveyor.server.vllm_metrics import export_vllm_names

logger = logging.getLogger("conveyor.serve")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key", action="append", default=[], help="accepted bearer key (repeatable); also CONVEYOR_API_KEY"
    )
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: from the file)")
    g.add_argument("--max-queued-requests", type=int, default=256, help="waiting requests before 503")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    g.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins (off by default)")
    g.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    g.add_argument(
        "--vllm-metrics",
        action="store_true",
        help="also export the main metrics under vLLM's names "
        "(vllm:*, labelled model_name), for dashboards made for vLLM",
    )
    g.add_argument(
        "--root-path",
        default="",
        help="path prefix of the app behind a proxy that strips it (e.g. /llm): the API answers under it and "
        "without it (as vLLM's --root-path)",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="streams always carry usage: in every chunk and in a last usage-only chunk, as if every request "
        "sent stream_options include_usage and continuous_usage_stats",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="name logprob tokens 'token_id:<id>' unless a request sets return_tokens_as_token_ids false",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="add usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix cache)",
    )
    g.add_argument(
        "--no-ui",
        action="store_true",
        help="do not serve the web page (playground and engine view) at /; the API, /v1/engine/status included, stays",
    )


def model_name(config: EngineConfig) -> str:
    if config.model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(config.model))
    return base[:-5] if base.endswith(".gguf") else base


SHUTDOWN_MESSAGE = (
    "the server is shutting down and --shutdown-timeout ran out before this request finished; it was aborted "
    "(retry it, on another server or once this one is back)"
)
"""What a request still in flight when the shutdown timeout runs out ends with: a 503 with Retry-After, or a
stream's error event with status 503 (error_code SHUTDOWN)."""


class Drainable(Protocol):
    """What draining waits on and aborts: the engine, or the data-parallel front's relays."""

    @property
    def num_active(self) -> int: ...

    def abort_all(self, reason: str) -> None: ...


class Draining(Protocol):
    draining: bool


class DrainingServer(uvicorn.Server):
    """On SIGTERM / SIGINT: refuse new work (503), let in-flight requests finish for up to
    `shutdown_timeout`, abort the rest (each a 503 with Retry-After, or a stream's error event), then exit 0."""

    def __init__(
        self, config: uvicorn.Config, state: Draining, shutdown_timeout: float, work: Drainable | None = None
    ) -> None:
        super().__init__(config)
        self.state = state
        self.work: Drainable = work if work is not None else state.engine  # type: ignore[attr-defined]
        self.shutdown_timeout = shutdown_timeout
        self._draining_started = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining_started:
            self.force_exit = sig == signal.SIGINT
            self.should_exit = True
            return
        self._draining_started = True
        self.state.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
        else:
            self.should_exit = True

    async def _drain(self) -> None:
        engine = self.work
        deadline = self._loop.time() + self.shutdown_timeout if self._loop else 0
        logger.info("draining: %d request(s) in flight, up to %.0f s", engine.num_active, self.shutdown_timeout)
        # polled: a count that changes from several places, and a deadline
        while engine.num_active and self._loop and self._loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if engine.num_active:
            logger.info("shutdown timeout: aborting %d request(s)", engine.num_active)
            engine.abort_all(SHUTDOWN_MESSAGE)
            for _ in range(100):
                if not engine.num_active:
                    break
                await asyncio.sleep(0.05)
        self.should_exit = True


def root_path(value: str) -> str:
    """--root-path as the ASGI root_path: '' (none), or '/' plus the prefix without a trailing slash."""
    stripped = value.strip().strip("/")
    if not stripped:
        return ""
    if any(c in stripped for c in "?#") or not stripped.isprintable() or " " in stripped:
        raise ConfigError(f"--root-path {value!r} is not a URL path prefix; give one such as /llm")
    return "/" + stripped


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(args.api_key) + ((os.environ["CONVEYOR_API_KEY"],) if os.environ.get("CONVEYOR_API_KEY") else ())


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    keys = api_keys(args)
    origins = tuple(args.allowed_origins)
    metrics = Metrics()
    engine = AsyncEngine(config, max_queued_requests=args.max_queued_requests, on_timings=metrics.observe)
    state = ServerState(
        engine,
        ServerOptions(
            model_name=args.served_model_name or model_name(config),
            api_keys=keys,
            max_body_bytes=args.max_body_bytes,
            request_timeout=args.request_timeout,
            allowed_origins=origins,
            ui=not args.no_ui,
            root_path=root_path(args.root_path),
            force_include_usage=args.enable_force_include_usage,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            prompt_tokens_details=args.enable_prompt_tokens_details,
        ),
        metrics,
    )
    if args.vllm_metrics:
        export_vllm_names(state.metrics, state.options.model_name, config)
    engine.start()  # loads the model in the background; /health says 503 until it is ready
    app = build_app(state)
    server = DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5),
        state,
        args.shutdown_timeout,
    )
    print(
        f"conveyor: serving {state.options.model_name} on http://{args.host}:{args.port} "
        f"(OpenAI API under /v1; GET /health turns 200 once the model is loaded"
        f"{'' if args.no_ui else '; the web page at /'})",
        flush=True,
    )
    watcher = threading.Thread(target=_exit_if_engine_fails, args=(engine, server), daemon=True)
    watcher.start()
    server.run()
    engine.stop()
    if engine.failed_to_start:
        print(f"conveyor: error: {engine.error}", flush=True)
        return 2
    return 0


def _exit_if_engine_fails(engine: AsyncEngine, server: uvicorn.Server) -> None:
    """A model that cannot load ends the server with a clear message instead of serving 503 forever."""
    while not engine.is_ready and engine.error is None:
        threading.Event().wait(0.2)
    if engine.failed_to_start:
        server.should_exit = True
