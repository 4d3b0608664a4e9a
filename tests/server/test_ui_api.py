"""The endpoints the web page uses, through plain HTTP: GET / and /ui/ (the page, no key needed,
nothing from outside), GET /v1/engine/status (counters and spans), and --no-ui."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.server.app import build_app
from conveyor.server.state import ServerOptions, ServerState
from conveyor.server.ui import STATIC_DIR
from helpers import REPO_ROOT
from helpers.server_process import ServerProcess

KEY = "ui-key-42"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _app(ui: bool, keys: tuple[str, ...] = ()) -> TestClient:
    """The app in-process around an engine that is never started (it stays 'loading')."""
    engine = AsyncEngine(EngineConfig())
    return TestClient(build_app(ServerState(engine, ServerOptions(model_name="m", api_keys=keys, ui=ui))))


def test_page_and_assets_are_served_without_a_key() -> None:
    client = _app(ui=True, keys=(KEY,))
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<base href="/">' in page.text  # the page's URLs are relative to it (--root-path: the prefix)
    assets = ["/" + a for a in re.findall(r'(?:src|href)="(ui/[^"]+)"', page.text)]
    assert {"/ui/app.css", "/ui/main.js"} <= set(assets)
    scripts = {f"/ui/{p.name}" for p in STATIC_DIR.glob("*.js")}
    for path in set(assets) | scripts:
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-type"].split(";")[0] in ("text/css", "text/javascript", "application/javascript")
    assert client.get("/ui/missing.js").status_code == 404
    assert client.get("/v1/engine/status").status_code == 401  # the API keeps its key


def test_static_files_fetch_nothing_from_elsewhere() -> None:
    """No CDN, no fonts, no analytics: every URL in the shipped files is same-origin."""
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        urls = re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, flags=re.I)
        assert not urls, f"{path.name} refers to {urls}"
    imports = {m for p in STATIC_DIR.glob("*.js") for m in re.findall(r'from "\./([^"]+)"', p.read_text())}
    assert imports <= {p.name for p in STATIC_DIR.glob("*.js")}  # every module imported is shipped


def test_no_ui_serves_no_page_and_keeps_the_api() -> None:
    client = _app(ui=False, keys=(KEY,))
    assert client.get("/").status_code == 401  # not public any more: the guard sees an ordinary path
    assert client.get("/", headers=AUTH).status_code == 404
    assert client.get("/ui/app.css", headers=AUTH).status_code == 404
    status = client.get("/v1/engine/status", headers=AUTH).json()
    assert status["state"] == "loading" and status["stats"] is None and status["spans"] == []


def test_status_parameters_are_validated() -> None:
    client = _app(ui=True)
    for query, param in (
        ("window=0", "window"),
        ("window=61", "window"),
        ("since=-1", "since"),
        ("since=abc", "since"),
    ):
        r = client.get(f"/v1/engine/status?{query}")
        assert r.status_code == 400, query
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--api-key", KEY, "--no-ui", "--max-num-seqs", "8")
    try:
        proc.wait_ready(timeout=300)  # loading the model takes longer on a busy machine
        yield proc
    finally:
        proc.stop()


def _status(server: ServerProcess, query: str = "") -> dict[str, Any]:
    r = httpx.get(server.url + "/v1/engine/status" + query, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_no_ui_flag_on_the_command_line(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/", headers=AUTH).status_code == 404
    r = httpx.get(server.url + "/v1/engine/status", timeout=10)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_status_during_and_after_a_burst(server: ServerProcess) -> None:
    before = _status(server)
    assert before["state"] == "ready" and before["model"] == "SmolLM2-135M-Instruct"
    max_tokens, burst = 24, 10  # 10 requests, at most 8 running: some wait
    replies: list[httpx.Response] = []

    def one(i: int) -> None:
        body = {"prompt": f"Request {i}: count slowly", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        replies.append(httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=300))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(burst)]
    for t in threads:
        t.start()
    busy: list[dict[str, Any]] = []
    while any(t.is_alive() for t in threads):
        busy.append(_status(server))
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in replies)
    seen = [s["stats"]["requests"] for s in busy]
    assert max(r["running"] for r in seen) > 1
    assert max(r["running"] for r in seen) <= 8
    assert max(r["waiting"] for r in seen) >= 1 or max(r["running"] for r in seen) == 8
    assert max(s["tokens_per_s"] for s in busy) > 0
    assert max(s["stats"]["kv_blocks"]["used"] for s in busy) > 0
    time.sleep(0.5)
    after = _status(server, f"?since={before['now']}")
    stats = after["stats"]
    assert stats["requests"] == {"running": 0, "waiting": 0, "preempted": 0, "in_server": 0}
    assert stats["kv_blocks"]["used"] == 0 and stats["kv_blocks"]["free"] == stats["kv_blocks"]["total"]
    assert stats["generated_tokens"] - before["stats"]["generated_tokens"] == burst * max_tokens
    assert 0 <= stats["prefix_cache"]["hit_rate"] <= 1 and 0 <= stats["device_idle_fraction"] <= 1
    device = [s for s in after["spans"] if s["lane"] == "device"]
    assert sum(s["sampled"] for s in device) == burst * max_tokens  # every token sampled by one recorded step
    assert max(s["seqs"] for s in device) > 1
    assert {s["name"] for s in after["spans"] if s["lane"] == "host"} == {"schedule", "prepare", "commit"}
    assert all(before["now"] < s["end"] <= after["now"] and s["start"] <= s["end"] for s in after["spans"])


def test_since_returns_only_newer_spans(server: ServerProcess) -> None:
    httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=AUTH, timeout=60)
    first = _status(server, "?window=60")
    assert first["spans"], "the request above ran steps"
    httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, headers=AUTH, timeout=60)
    second = _status(server, f"?since={first['now']}")
    assert second["now"] > first["now"]
    assert second["spans"] and all(s["end"] > first["now"] for s in second["spans"])
    older = {(s["lane"], s["name"], s["start"]) for s in first["spans"]}
    assert not older & {(s["lane"], s["name"], s["start"]) for s in second["spans"]}


def test_page_files_are_in_the_package_data() -> None:
    """`pip install` (not only an editable checkout) must ship the page."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    patterns = re.search(r'"conveyor.server" = \[([^\]]*)\]', pyproject)
    assert patterns, "pyproject.toml has no package-data entry for conveyor.server"
    globs = re.findall(r'"([^"]+)"', patterns.group(1))
    shipped = {p for g in globs for p in STATIC_DIR.parent.glob(g)}
    assert shipped == set(STATIC_DIR.iterdir())
