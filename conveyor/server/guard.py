"""The guard every HTTP request passes before routing: API keys, the body-size cap, and 503 while draining."""

from __future__ import annotations

import hmac
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.server.error_responses import error_response
from conveyor.server.state import ServerOptions
from conveyor.server.ui import is_page_path

OPEN_PATHS = ("/health", "/ping", "/metrics", "/version")
"""Paths served without an API key (as vLLM guards only /v1): probes and Prometheus scrapes."""


class Guarded(Protocol):
    """What the guard reads: a server's state, or the data-parallel front."""

    options: ServerOptions
    draining: bool


class GuardMiddleware:
    """Pure ASGI: API keys (decided on the raw path, constant-time compare), body-size cap,
    and 503 while draining — before any routing or body parsing."""

    def __init__(self, app: ASGIApp, state: Guarded) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        opts = self.state.options
        path = _route_path(scope.get("raw_path", scope["path"].encode()).split(b"?", 1)[0].decode("latin-1"), opts)
        public = path in OPEN_PATHS or (opts.ui and is_page_path(path))
        if opts.api_keys and not public and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            ok = False
            for key in opts.api_keys:  # compare against every key, always
                ok |= hmac.compare_digest(token.encode(), key.encode())
            if not ok:
                await error_response(
                    401, "missing or invalid API key; send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )(scope, receive, send)
                return
        if self.state.draining and path not in OPEN_PATHS and scope["method"] == "POST":
            await error_response(
                503,
                "the server is shutting down and takes no new requests",
                code="draining",
                headers={"Retry-After": "5"},
            )(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > opts.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        received = 0

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > opts.max_body_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, capped_receive, send)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        """413, before the body is read (or the rest of it). The connection stays open: the HTTP server discards
        the rest of the body as it arrives and then reads the next request. Closing it instead would reset a
        client still sending its body, which then never sees the 413."""
        await error_response(
            413, f"the request body is larger than {self.state.options.max_body_bytes} bytes", code="body_too_large"
        )(scope, receive, send)


def _route_path(path: str, options: ServerOptions) -> str:
    """The path the routes see: without --root-path's prefix when it starts with it (the app answers under the
    prefix and without it, as a proxy may or may not strip it)."""
    root = options.root_path
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


class _BodyTooLarge(BaseException):
    """Raised from the capped receive. A BaseException, so that it passes the framework's catch-all around body
    parsing (FastAPI turns any Exception raised there into a 400) and reaches the guard, which answers 413."""
