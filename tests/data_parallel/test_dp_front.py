"""The data-parallel front's relay (conveyor/data_parallel/serving/front.py) against real upstream HTTP servers
that fail
the way a killed replica does: a connection refused before any byte (the request is sent to the other
replica), and a stream cut after some events (the client gets them, then an error event and [DONE]).
No Ray: the replica set is a plain stand-in naming two upstream addresses."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from conveyor.data_parallel.serving.front import Front, build_front_app
from conveyor.server.state import ServerOptions


@dataclass
class Upstream:
    index: int
    address: str | None
    healthy: bool = True
    restarts: int = 0
    pid: int | None = None


class TwoReplicas:
    """What Front reads of a ReplicaSet: the replicas, which are up, the key, and mark_down."""

    def __init__(self, addresses: list[str | None]) -> None:
        self.replicas = [Upstream(i, a) for i, a in enumerate(addresses)]
        self.api_key = "k"
        self.on_change: Any = None
        self.marked_down: list[int] = []

    @property
    def healthy(self) -> list[int]:
        return [r.index for r in self.replicas if r.healthy and r.address is not None]

    def mark_down(self, index: int) -> None:
        self.marked_down.append(index)
        self.replicas[index].healthy = False


def _upstream_app(cut_after: int | None) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            for i in range(4):
                if cut_after is not None and i == cut_after:
                    raise RuntimeError("replica died")  # uvicorn drops the connection mid-body
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': str(i), 'token_ids': [i]}]})}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture()
def upstream() -> Iterator[Any]:
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(cut_after: int | None) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(_upstream_app(cut_after), log_level="critical"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        servers.append((server, thread))
        return f"127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=5)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


async def _post(front: Front) -> tuple[int, dict[str, str], list[str]]:
    transport = httpx.ASGITransport(app=build_front_app(front))
    async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
        response = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": True})
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        return response.status_code, dict(response.headers), events


def test_a_replica_that_refuses_the_connection_gets_the_request_sent_to_the_other(upstream: Any) -> None:
    replicas = TwoReplicas([_closed_port(), upstream(None)])
    front = Front(replicas, ServerOptions(model_name="m", request_timeout=30.0), block_size=16)
    front.router.outstanding[1] = 10  # so the router's first choice is the dead replica 0
    status, headers, events = asyncio.run(_post(front))
    assert status == 200 and headers["x-conveyor-replica"] == "1"
    assert events[-1] == "[DONE]" and [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == list("0123")
    assert (
        replicas.marked_down == [0]
        and front.metrics.registry.get_sample_value("conveyor_dp_requests_retried_total") == 1
    )
    assert front.num_active == 0 and front.router.outstanding == [0, 10]


def test_a_stream_cut_after_tokens_ends_with_an_error_event_and_done(upstream: Any) -> None:
    replicas = TwoReplicas([upstream(2), None])
    front = Front(replicas, ServerOptions(model_name="m", request_timeout=30.0), block_size=16)
    status, _, events = asyncio.run(_post(front))
    assert status == 200
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["0", "1"]
    error = json.loads(events[2])["error"]
    assert error["code"] == "replica_lost" and "replica 0" in error["message"]
    assert events[3:] == ["[DONE]"]
    assert replicas.marked_down == [0] and front.num_active == 0 and front.router.outstanding == [0, 0]


def test_no_replica_up_is_a_503_naming_it() -> None:
    replicas = TwoReplicas([None, None])
    front = Front(replicas, ServerOptions(model_name="m"), block_size=16)
    status, _, _ = asyncio.run(_post(front))
    assert status == 503
    assert front.health().status_code == 503


def test_a_client_gone_at_once_still_frees_its_route_and_upstream(upstream: Any) -> None:
    """The client disconnects as soon as its request is read: whether or not the relay ever started, the
    request stops counting as in flight and against its replica's load."""
    replicas = TwoReplicas([upstream(None), None])
    front = Front(replicas, ServerOptions(model_name="m", request_timeout=30.0), block_size=16)
    app = build_front_app(front)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("front", 80),
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert sent and sent[0]["type"] == "http.response.start"
    assert front.num_active == 0 and front.router.outstanding == [0, 0] and not front._open
