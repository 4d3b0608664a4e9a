"""SIGTERM: refuse new work with 503, let in-flight requests finish up to the timeout, abort the rest, exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx

from helpers.server_process import ServerProcess


def _stream(url: str, body: dict[str, Any], sink: list[str]) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                sink.append(line)


def test_sigterm_drains_then_exits_zero() -> None:
    # the short stream (12 tokens) ends well inside the 8 s drain window on any CPU; the long one (1900) cannot
    server = ServerProcess("--shutdown-timeout", "8")
    try:
        server.wait_ready()
        short: list[str] = []
        long: list[str] = []
        base = {"prompt": "Count:", "temperature": 0, "ignore_eos": True, "stream": True}
        threads = [
            threading.Thread(target=_stream, args=(server.url, base | {"max_tokens": 12}, short)),
            threading.Thread(target=_stream, args=(server.url, base | {"max_tokens": 1900}, long)),
        ]
        for t in threads:
            t.start()
        while len(long) < 3:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert httpx.get(server.url + "/health").status_code == 503
        for t in threads:
            t.join(timeout=60)
        assert short[-1] == "data: [DONE]"
        assert json.loads(short[-2][6:])["choices"][0]["finish_reason"] == "length"  # finished normally
        assert long[-1] == "data: [DONE]"
        error = json.loads(long[-2][6:])["error"]  # aborted at the timeout: a 503 to retry elsewhere
        assert "shutting down" in error["message"] and error["code"] == "shutdown"
        assert error["type"] == "service_unavailable_error"
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
