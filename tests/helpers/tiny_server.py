"""A real HTTP server (uvicorn on a free loopback port) in this process, around a tiny random model with a small
tokenizer and a chat template: every route works, text and chat included, at a fraction of the default model's cost.
The fast tier's server tests use it; `engine()` gives the in-process Engine for tests that reach into the model."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.engine import Engine
from conveyor.server.app import build_app
from conveyor.server.metrics import Metrics
from conveyor.server.state import ServerOptions, ServerState
from helpers.server_process import free_port
from helpers.structured_schemas import save_small_tokenizer
from helpers.tiny_models import build_tiny_model

TINY_VOCAB = 520
"""The tiny model's vocabulary: the small tokenizer's 500 tokens and 20 more (real models pad theirs too)."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def build_tiny_chat_model(folder: str, chat_template: str = CHAT_TEMPLATE) -> str:
    """A tiny Llama with a byte-level BPE tokenizer of 500 tokens ("</s>" = 1 ends a reply) and a chat template."""
    build_tiny_model("llama", folder, vocab_size=TINY_VOCAB, eos_token_id=1, bos_token_id=0)
    save_small_tokenizer(folder)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(config | {"chat_template": chat_template}, f)
    return folder


class TinyServer:
    """`with TinyServer(folder, max_body_bytes=...) as server:` serves at `server.url` until the block ends."""

    def __init__(self, folder: str, **options: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = EngineConfig(model=folder, max_model_len=512, kv_cache_memory=4 * 2**20, block_size=8)
        self.metrics = Metrics()
        self.async_engine = AsyncEngine(config, max_queued_requests=64, on_timings=self.metrics.observe)
        self.state = ServerState(self.async_engine, ServerOptions(model_name="tiny", **options), self.metrics)
        self.server = uvicorn.Server(
            uvicorn.Config(build_app(self.state), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self.server.run, name="tiny-server", daemon=True)

    def engine(self) -> Engine:
        """The engine itself (tests only: it belongs to the engine thread; touch it between requests)."""
        engine = self.async_engine._engine
        assert engine is not None
        return engine

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def __enter__(self) -> TinyServer:
        self.async_engine.start()
        self._thread.start()
        deadline = time.time() + 120
        while time.time() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            if self.async_engine.error is not None:
                break
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"the tiny server did not become healthy ({self.async_engine.error})")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self.async_engine.stop()


@contextlib.contextmanager
def tiny_server(folder: str, **options: Any) -> Iterator[TinyServer]:
    with TinyServer(folder, **options) as server:
        yield server
