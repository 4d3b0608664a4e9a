"""The server's options (from the command line) and its state (the engine, metrics, draining), read by the
guard, the routes and the page."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.async_engine import AsyncEngine
from conveyor.server.metrics import Metrics

__all__ = ["ServerOptions", "ServerState"]


@dataclass
class ServerOptions:
    model_name: str
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    request_timeout: float | None = None
    allowed_origins: tuple[str, ...] = ()
    ui: bool = True
    """Serve the web page at / and /ui/ (off with --no-ui)."""


@dataclass
class ServerState:
    engine: AsyncEngine
    options: ServerOptions
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
