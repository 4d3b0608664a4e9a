"""The data-parallel front: an HTTP server that sends each generation request to one replica, chosen by the
prefix-affinity router among the replicas that are up, and relays the answer (streamed or whole) back.

    client ──► front (this process: guard, router, relay) ──httpx──► replica i's own OpenAI server

Faults: a replica that cannot be reached before it answers (connect error, or it died before its first
byte) gets the request again on another replica; a stream whose replica stops after sending tokens ends
with an OpenAI-shaped error event and `[DONE]`. A client that goes away closes the upstream connection, and
the replica's server aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from conveyor import __version__
from conveyor.data_parallel.replicas import ReplicaSet
from conveyor.data_parallel.router import PrefixAffinityRouter, Route
from conveyor.data_parallel.serving.front_metrics import FrontMetrics
from conveyor.server.error_responses import error_response, install_error_handlers, sse_error
from conveyor.server.guard import GuardMiddleware
from conveyor.server.request_id import HEADER, RequestIdMiddleware
from conveyor.server.state import ServerOptions

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
REPLICA_HEADER = "X-Conveyor-Replica"
"""Response header naming the replica that answered (for operators and tests)."""
DEFAULT_MAX_TOKENS_GUESS = 256
"""Outstanding tokens counted for a request that names no max_tokens (the router only balances with it)."""
_DONE = b"data: [DONE]"


class Front:
    """The router, the relay and the counters; one per front process (its methods run on the server's loop)."""

    def __init__(self, replicas: ReplicaSet, options: ServerOptions, block_size: int) -> None:
        self.replicas = replicas
        self.options = options
        self.draining = False
        n = len(replicas.replicas)
        self.router = PrefixAffinityRouter(n, block_size)
        self.metrics = FrontMetrics(n)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=options.request_timeout, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            headers={"Authorization": f"Bearer {replicas.api_key}"},
        )
        self._open: set[httpx.Response] = set()
        self._closing: set[asyncio.Future[None]] = set()
        """Upstream responses being relayed (abort_all closes them)."""
        self._abort_reason: str | None = None
        self._in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        replicas.on_change = self._replica_changed

    # ---- replicas coming and going -----------------------------------------------------
    def _replica_changed(self, index: int, up: bool) -> None:
        """From the watcher thread: a replica that is back has an empty cache, so forget what it held."""
        if up and self._loop is not None:
            self._loop.call_soon_threadsafe(self.router.forget_replica, index)

    @property
    def num_active(self) -> int:
        """Generation requests in flight (routed and not yet answered, or still streaming)."""
        return self._in_flight

    def abort_all(self, reason: str) -> None:
        """Close every upstream stream: each client gets an error event naming `reason`, then [DONE]."""
        self._abort_reason = reason
        for response in list(self._open):
            closing = asyncio.ensure_future(response.aclose())
            self._closing.add(closing)  # held until done: the loop keeps only a weak reference to a task
            closing.add_done_callback(self._closing.discard)

    # ---- routing ---------------------------------------------------------------------
    async def _prompt_ids(self, path: str, payload: dict[str, Any]) -> list[int]:
        """The prompt's token ids, for the prefix hash; [] (route by load alone) when they cannot be had."""
        if path == "/v1/completions":
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]  # a batch: its first prompt decides
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return prompt
            query: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {}
        else:
            messages = payload.get("messages")
            query = {"messages": messages} if isinstance(messages, list) and messages else {}
        healthy = self.replicas.healthy
        if not query or not healthy:
            return []
        address = self.replicas.replicas[healthy[0]].address
        try:  # the replica's tokenizer and chat template: the same ids its block hashes see
            response = await self.client.post(f"http://{address}/tokenize", json=query, timeout=10.0)
            tokens = response.json().get("tokens") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            tokens = None
        return tokens if isinstance(tokens, list) else []

    async def generate(self, request: Request, path: str) -> Response:
        """Route and relay one generation request; counted in num_active until answered (or, streamed, until
        its relay ends), so that draining waits for it."""
        self._loop = asyncio.get_running_loop()
        self._in_flight += 1
        response: Response | None = None
        try:
            response = await self._generate(request, path)
            return response
        finally:
            if not isinstance(response, StreamingResponse):
                self._in_flight -= 1  # a stream's relay counts itself down when it ends

    async def _generate(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError as exc:
            return error_response(400, f"the request body is not JSON ({exc})")
        if not isinstance(payload, dict):
            return error_response(400, f"the request body must be a JSON object, got {type(payload).__name__}")
        streamed = payload.get("stream") is True
        max_tokens = payload.get("max_tokens", payload.get("max_completion_tokens"))
        n_given = payload.get("n")
        n = n_given if isinstance(n_given, int) else 1
        budget = (max_tokens if isinstance(max_tokens, int) else DEFAULT_MAX_TOKENS_GUESS) * max(1, n)
        ids = await self._prompt_ids(path, payload)
        headers = {"content-type": "application/json", HEADER: request.state.request_id}
        tried: set[int] = set()
        while True:
            candidates = [i for i in self.replicas.healthy if i not in tried]
            if not candidates:
                return error_response(
                    503,
                    f"no data-parallel replica is up to take the request (replicas tried: "
                    f"{sorted(tried) or 'none'}); retry shortly",
                    code="no_replica",
                    headers={"Retry-After": "2"},
                )
            unavailable = set(range(len(self.replicas.replicas))) - set(candidates)
            route = self.router.route(ids, budget, unavailable=unavailable)
            address = self.replicas.replicas[route.replica].address
            upstream: httpx.Response | None = None
            try:
                if address is None:
                    raise httpx.ConnectError("the replica went down")
                upstream = await self.client.send(
                    self.client.build_request("POST", f"http://{address}{path}", content=body, headers=headers),
                    stream=True,
                )
                if not (streamed and upstream.status_code == 200):
                    content = await upstream.aread()  # nothing reaches the client before the whole answer
                    self.router.finished(route)
                    await upstream.aclose()
                    self._count(route)
                    return Response(
                        content,
                        status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type"),
                        headers={REPLICA_HEADER: str(route.replica)},
                    )
                chunks = upstream.aiter_raw()
                first = await anext(chunks, b"")  # until the replica has sent something, it may be retried
            except httpx.TransportError as exc:
                self.router.finished(route)
                if upstream is not None:
                    await upstream.aclose()
                logger.warning(
                    "replica %d could not be reached for a request (%s); trying another",
                    route.replica,
                    type(exc).__name__,
                )
                self.replicas.mark_down(route.replica)
                self.metrics.retried.inc()
                tried.add(route.replica)
                continue
            self._count(route)
            self._open.add(upstream)
            end = _RelayEnd(self, upstream, route)
            return _RelayResponse(
                self._relay(chunks, first, route, end),
                end,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", REPLICA_HEADER: str(route.replica)},
            )

    async def finish_relay(self, upstream: httpx.Response, route: Route) -> None:
        """A relayed stream ended (see _RelayEnd: called once per stream)."""
        self._open.discard(upstream)
        self._in_flight -= 1
        self.router.finished(route)
        await upstream.aclose()  # a client that went away: the replica sees it and aborts the request

    def _count(self, route: Route) -> None:
        self.metrics.routed.labels(str(route.replica)).inc()
        if route.matched_blocks:
            self.metrics.affinity_hits.labels(str(route.replica)).inc()

    async def _relay(
        self, chunks: AsyncIterator[bytes], first: bytes, route: Route, end: _RelayEnd
    ) -> AsyncIterator[bytes]:
        """The replica's events as they come; if it stops before [DONE], an error event and [DONE]."""
        tail = first[-64:]
        try:
            if first:
                yield first
            try:
                async for chunk in chunks:
                    tail = (tail + chunk)[-64:]
                    yield chunk
            except httpx.TransportError:
                pass  # told below
            if _DONE not in tail:
                self.metrics.streams_lost.inc()
                reason = self._abort_reason or (
                    f"data-parallel replica {route.replica} stopped while streaming "
                    f"this response; the tokens sent are all there will be: retry "
                    f"the request"
                )
                if self._abort_reason is None:
                    self.replicas.mark_down(route.replica)
                yield sse_error(502, reason, code="replica_lost").encode()
                yield b"data: [DONE]\n\n"
        finally:
            await end()

    # ---- the rest --------------------------------------------------------------------
    async def pass_through(self, request: Request, path: str) -> Response:
        healthy = self.replicas.healthy
        if not healthy:
            return error_response(
                503, "no data-parallel replica is up; retry shortly", code="no_replica", headers={"Retry-After": "2"}
            )
        address = self.replicas.replicas[healthy[0]].address
        try:
            response = await self.client.request(
                request.method,
                f"http://{address}{path}",
                content=await request.body(),
                headers={"content-type": "application/json"},
            )
        except httpx.TransportError as exc:
            return error_response(
                502, f"replica {healthy[0]} could not be reached ({type(exc).__name__}); retry", code="replica_lost"
            )
        return Response(
            response.content, status_code=response.status_code, media_type=response.headers.get("content-type")
        )

    def health(self) -> Response:
        healthy = set(self.replicas.healthy)
        states = [
            {"replica": r.index, "up": r.index in healthy, "restarts": r.restarts, "pid": r.pid}
            for r in self.replicas.replicas
        ]
        up = sum(1 for s in states if s["up"])
        if self.draining:
            return error_response(503, "the server is shutting down", code="draining")
        if up == 0:
            return JSONResponse({"status": "down", "replicas": states}, status_code=503)
        return JSONResponse({"status": "ok" if up == len(states) else "degraded", "replicas": states})

    async def metrics_text(self) -> bytes:
        async def scrape(i: int) -> tuple[int, str | None]:
            try:
                response = await self.client.get(f"http://{self.replicas.replicas[i].address}/metrics", timeout=5.0)
                return i, response.text if response.status_code == 200 else None
            except httpx.HTTPError:
                return i, None

        for r in self.replicas.replicas:
            self.metrics.up.labels(str(r.index)).set(1 if r.index in self.replicas.healthy else 0)
            self.metrics.restarts.labels(str(r.index)).set(r.restarts)
            self.metrics.outstanding.labels(str(r.index)).set(self.router.outstanding[r.index])
        scraped = await asyncio.gather(*(scrape(i) for i in self.replicas.healthy))
        return self.metrics.render({i: text for i, text in scraped if text is not None})

    async def close(self) -> None:
        await self.client.aclose()


class _RelayEnd:
    """Ends one relayed stream exactly once: whichever comes first, the relay finishing or the response
    ending without ever starting it (a client gone before the first byte)."""

    def __init__(self, front: Front, upstream: httpx.Response, route: Route) -> None:
        self.front, self.upstream, self.route = front, upstream, route
        self.done = False

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        await self.front.finish_relay(self.upstream, self.route)


class _RelayResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], end: _RelayEnd, **options: Any) -> None:
        super().__init__(content, **options)
        self.end = end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.end()


def build_front_app(front: Front) -> FastAPI:
    app = FastAPI(title="Conveyor (data-parallel front)", version=__version__, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    if front.options.allowed_origins:
        origins = list(front.options.allowed_origins)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_credentials="*" not in origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(GuardMiddleware, state=front)  # API keys, body cap, 503 while draining
    app.add_middleware(RequestIdMiddleware)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return front.health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await front.metrics_text(), media_type="text/plain; version=0.0.4")

    def relay_to_replica(path: str) -> Any:
        async def generate(request: Request) -> Response:
            return await front.generate(request, path)

        return generate

    for path in GENERATION_PATHS:
        app.add_api_route(path, relay_to_replica(path), methods=["POST"])

    # routes any replica answers the same way: sent to one that is up
    @app.api_route("/v1/models", methods=["GET"])
    @app.api_route("/v1/models/{model_id:path}", methods=["GET"])
    @app.api_route("/tokenize", methods=["POST"])
    @app.api_route("/detokenize", methods=["POST"])
    @app.api_route("/tokenizer_info", methods=["GET"])
    async def passed_through(request: Request) -> Response:
        return await front.pass_through(request, request.url.path)

    return app
