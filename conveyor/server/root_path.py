"""--root-path: the app behind a proxy that serves it under a path prefix (as vLLM's --root-path).

The prefix becomes the ASGI root_path of every request, so the routes answer both under it (a proxy that passes the
prefix on: /llm/v1/models) and without it (one that strips it: /v1/models), and the OpenAPI schema names it as the
server's URL. FastAPI's own root_path argument did the same; this middleware keeps it without that argument.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class RootPathMiddleware:
    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)
