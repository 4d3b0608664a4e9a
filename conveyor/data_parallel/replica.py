"""ReplicaServer: one engine replica inside a Ray actor, serving HTTP on a free port.

Ray places the actor and restarts it when its process dies; requests and tokens never pass through Ray.
They reach the replica over HTTP as JSON or server-sent events, so nothing crosses the process boundary as
a pickle. The actor's constructor arguments and method results are plain strings and integers (Ray encodes
those with msgpack).

    front process ──HTTP (JSON / SSE, bearer key)──► replica actor: uvicorn + AsyncEngine (rank 0)
                                                              └─ stdin pipe + gloo ─► TP workers 1..N-1

Which HTTP app the replica serves is named by `app_factory`, "module:function" as uvicorn names apps: the
server's OpenAI app (conveyor/data_parallel/serving/replica_app.py) for `conveyor serve`, or the offline route for LLM
(conveyor/data_parallel/offline.py). Either answers GET /health, which the front's watcher polls.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

AppFactory = Callable[[AsyncEngine, str, str], Any]
"""(engine, model name, bearer key) -> an ASGI app that serves the engine."""


def load_factory(name: str) -> AppFactory:
    module, _, function = name.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"replica app factory {name!r} not found ({exc}); name it as 'package.module:function'"
        ) from None


class ReplicaServer:
    """Runs in a Ray actor: builds the engine (its TP workers are this process's children), serves HTTP."""

    def __init__(
        self, config_json: str, index: int, app_factory: str, model_name: str, api_key: str, host: str
    ) -> None:
        config = EngineConfig(**json.loads(config_json))
        self.index = index
        self.engine = AsyncEngine(config, max_queued_requests=1 << 16)  # the front bounds what it sends
        app = load_factory(app_factory)(self.engine, model_name, api_key)
        self.engine.start()
        if host == "node":  # on a multi-node cluster the front reaches this replica at its node's address
            import ray

            host = ray.util.get_node_ip_address()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.host, self.port = host, sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name=f"conveyor-replica-{index}", daemon=True
        )
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
