"""The soak's side of the server: a `conveyor serve` process it starts itself (when given no --url), the
server's resident memory, and its Prometheus metrics."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx


@dataclass
class LocalServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: str
    exit_code: int | None = None
    """The server's exit status after SIGTERM (0: it drained and stopped as documented)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(port: int, max_model_len: int, max_body_bytes: int, model: str | None, extra: list[str]) -> list[str]:
    """The `conveyor serve` command line the soak starts."""
    command = [sys.executable, "-m", "conveyor.cli", "serve", "--port", str(port), "--no-ui"]
    command += ["--max-model-len", str(max_model_len), "--max-body-bytes", str(max_body_bytes)]
    if model:
        command += ["--model", model]
    return command + extra


@contextlib.contextmanager
def local_server(
    max_model_len: int,
    max_body_bytes: int,
    model: str | None,
    extra: list[str],
    log_path: str,
    ready_timeout_s: float = 600.0,
) -> Iterator[LocalServer]:
    """A `conveyor serve` process on a free loopback port, its output in `log_path`, healthy when yielded and
    stopped with SIGTERM afterwards (its exit status in `exit_code`)."""
    port = free_port()
    command = serve_command(port, max_model_len, max_body_bytes, model, extra)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    server = LocalServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.time() + ready_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with status {process.returncode} before it was ready; see {log_path}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise TimeoutError(f"the server was not ready after {ready_timeout_s:.0f} s; see {log_path}")
            time.sleep(0.5)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        server.exit_code = process.returncode


def read_rss(pid: int) -> int | None:
    """Resident memory of a process, in bytes (Linux: /proc; elsewhere psutil when installed; else None)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:
        return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series (with its labels): value}."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values
