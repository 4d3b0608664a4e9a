"""X-Request-Id, as vLLM: every response carries one, the client's own when it sent one, else a new one; the
id of a completion is `<cmpl|chatcmpl>-<that id>`. The engine keeps its own unique ids, so two requests
with the same X-Request-Id never collide."""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.server.error_responses import error_response

HEADER = "x-request-id"
MAX_LENGTH = 256


class RequestIdMiddleware:
    """Pure ASGI (streams pass untouched): reads or makes the id, keeps it in scope["state"], sets the header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER.encode())
        request_id = given.decode("latin-1").strip() if given is not None else uuid.uuid4().hex[:24]
        if not 0 < len(request_id) <= MAX_LENGTH or not request_id.isprintable():
            await error_response(
                400,
                f"the X-Request-Id header must be 1 to {MAX_LENGTH} printable characters "
                f"(got {len(request_id)} characters); send another or leave it out",
                "X-Request-Id",
            )(scope, receive, send)
            return
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def response_id(request: Request, prefix: str) -> str:
    """`prefix-<X-Request-Id>` (the id the middleware read or made)."""
    return f"{prefix}-{request.state.request_id}"
