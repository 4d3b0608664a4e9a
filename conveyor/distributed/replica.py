"""ReplicaServer: one engine replica inside a Ray actor, serving Conveyor's own HTTP API on a free port.

Ray places the actor and restarts it when its process dies; requests and tokens never pass through Ray.
They reach the replica over HTTP (the OpenAI routes of conveyor/server, plus the offline route below),
as JSON or server-sent events, so nothing crosses the process boundary as a pickle. The actor's
constructor arguments and method results are plain strings and integers (Ray encodes those with msgpack).

    front process ──HTTP (JSON / SSE, bearer key)──► replica actor: uvicorn + AsyncEngine (rank 0)
                                                              └─ stdin pipe + gloo ─► TP workers 1..N-1
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.errors import InvalidRequestError
from conveyor.outputs import RequestOutput
from conveyor.params import SamplingParams
from conveyor.server.app import build_app
from conveyor.server.guard import ServerOptions, ServerState
from conveyor.server.metrics import Metrics
from conveyor.server.serving import new_id

logger = logging.getLogger(__name__)

OFFLINE_ROUTE = "/conveyor/v1/generate"
"""LLM.generate's route to a replica: SamplingParams in, RequestOutput out, both as JSON."""


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str | list[int] = Field(union_mode="left_to_right")
    params: dict[str, Any]


def output_as_json(out: RequestOutput) -> dict[str, Any]:
    """The parts of a RequestOutput that travel (logprobs are refused before sending: see offline.py)."""
    return {"request_id": out.request_id, "prompt": out.prompt, "prompt_token_ids": list(out.prompt_token_ids),
            "num_cached_tokens": out.num_cached_tokens, "error": out.error, "error_code": out.error_code,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]}


def add_offline_route(app: FastAPI, engine: AsyncEngine) -> None:
    @app.post(OFFLINE_ROUTE)
    async def generate(body: GenerateBody) -> dict[str, Any]:
        if not engine.is_ready:
            raise InvalidRequestError("the replica's model is still loading")
        params = SamplingParams.model_validate(body.params)
        last: RequestOutput | None = None
        async for out in engine.generate(body.prompt, params, new_id("llm")):
            last = out
        assert last is not None and last.finished
        return output_as_json(last)


class ReplicaServer:
    """Runs in a Ray actor: builds the engine (its TP workers are this process's children), serves HTTP."""

    def __init__(self, config_json: str, index: int, model_name: str, api_key: str, host: str) -> None:
        config = EngineConfig(**json.loads(config_json))
        self.index = index
        self.engine = AsyncEngine(config, max_queued_requests=1 << 16)  # the front bounds what it sends
        state = ServerState(self.engine, ServerOptions(model_name=model_name, api_keys=(api_key,), ui=False,
                                                       max_body_bytes=64 * 2**20), Metrics())
        app = build_app(state)
        add_offline_route(app, self.engine)
        self.engine.start()
        if host == "node":  # on a multi-node cluster the front reaches this replica at its node's address
            import ray

            host = ray.util.get_node_ip_address()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.host, self.port = host, sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name=f"conveyor-replica-{index}", daemon=True)
        self.thread.start()
        logger.info("replica %d: pid %d serving on %s:%d", index, os.getpid(), host, self.port)

    def address(self) -> str:
        """host:port of this replica's HTTP server (a restarted replica has a new one)."""
        return f"{self.host}:{self.port}"

    def pid(self) -> int:
        return os.getpid()

    def status(self) -> str:
        """'loading', 'ready', or 'failed: <why>' (the model could not load)."""
        if self.engine.failed_to_start or self.engine.is_dead:
            return f"failed: {self.engine.error}"
        return "ready" if self.engine.is_ready and self.server.started else "loading"

    def stop(self) -> str:
        """Stop serving and end the engine and its TP workers; 'stopped' when done."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.stop()  # joins the engine thread, which closes its TP workers
        return "stopped"
