"""The app a data-parallel replica serves for `conveyor serve`: the same OpenAI routes as a single server,
open only to the front's bearer key (conveyor/data_parallel/replica.py runs it; front.py relays to it)."""

from __future__ import annotations

from fastapi import FastAPI

from conveyor.engine.async_engine import AsyncEngine
from conveyor.server.app import build_app
from conveyor.server.metrics import Metrics
from conveyor.server.state import ServerOptions, ServerState

MAX_BODY_BYTES = 64 * 2**20
"""The front applies the user's cap; this one only bounds what the front may pass on."""


def build_replica_app(engine: AsyncEngine, model_name: str, api_key: str) -> FastAPI:
    state = ServerState(
        engine,
        ServerOptions(model_name=model_name, api_keys=(api_key,), ui=False, max_body_bytes=MAX_BODY_BYTES),
        Metrics(),
    )
    return build_app(state)
