"""Start a real `conveyor serve` process on a free loopback port for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "conveyor.cli",
            "serve",
            "--port",
            str(self.port),
            "--kv-cache-memory",
            "256MiB",
            "--max-model-len",
            "2048",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )
        self._stopping = False
        self._http: httpx.Client | None = None

    @property
    def http(self) -> httpx.Client:
        """A client for the tests of this server to share (each httpx.post or httpx.get builds a client of its own,
        loading the CA bundle: about a tenth of a second of CPU a request); closed by `stop()`."""
        if self._http is None:
            self._http = httpx.Client()
        return self._http

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.proc.stdout.read() if self.proc.stdout else ''}")
            try:
                if self.http.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("server did not become healthy")

    def begin_stop(self) -> None:
        """Send SIGTERM, once; `stop()` then waits for the exit. Servers stopped together shut down side by side."""
        if self.proc.poll() is None and not self._stopping:
            self._stopping = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        if self._http is not None:
            self._http.close()
            self._http = None
        self.begin_stop()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metric(self, name: str, headers: dict[str, Any] | None = None) -> float:
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        for line in text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@contextlib.contextmanager
def running_server(*args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A started server that answers /health, stopped (SIGTERM) on the way out: `with running_server(...) as
    server:`, or a module fixture's `yield`."""
    proc = ServerProcess(*args, env=env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
