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
    root_path: str = ""
    """The path prefix a proxy serves the app under and strips (--root-path): the app answers both under it and
    without it, and reports it as the ASGI root_path (FastAPI's root_path)."""
    force_include_usage: bool = False
    """Every stream carries usage as if stream_options.include_usage and continuous_usage_stats were true
    (--enable-force-include-usage)."""
    return_tokens_as_token_ids: bool = False
    """Logprob tokens are 'token_id:<id>' unless a request's return_tokens_as_token_ids says otherwise
    (--return-tokens-as-token-ids)."""
    prompt_tokens_details: bool = False
    """usage.prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache
    (--enable-prompt-tokens-details)."""


@dataclass
class ServerState:
    engine: AsyncEngine
    options: ServerOptions
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
