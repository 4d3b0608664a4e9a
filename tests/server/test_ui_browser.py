"""The web page in a real headless browser: Debian's chromium driven by Playwright for Python
(which never downloads a browser of its own here). Skipped, with the reason, where either is
missing; scripts/test.sh installs both (apt and pip) when it can.

Set CONVEYOR_UI_SCREENSHOTS=docs to also write the screenshots in docs/ (README.md and docs/server.md show them)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.server_process import ServerProcess

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "browser-key-7"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCREENSHOTS = os.environ.get("CONVEYOR_UI_SCREENSHOTS")
WAIT_MS = 120_000  # generous: the CI machine has 2 cores shared with the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("browser tests need Playwright for Python: pip install playwright (scripts/test.sh installs it)")
    if not os.path.exists(CHROMIUM):
        pytest.skip(
            f"browser tests need Debian's chromium at {CHROMIUM}: apt-get install -y chromium "
            f"(scripts/test.sh installs it when run as root with apt)"
        )
    with sync_playwright() as p:
        try:
            instance = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        except Exception as exc:  # installed but cannot start here (no sandbox support, missing libraries)
            pytest.skip(f"{CHROMIUM} is installed but does not start: {str(exc).splitlines()[0]}")
        yield instance
        instance.close()


@pytest.fixture(scope="module")
def server(browser: Any) -> Iterator[ServerProcess]:
    proc = ServerProcess("--api-key", KEY, "--max-num-seqs", "8")
    try:
        proc.wait_ready(timeout=300)  # loading the model takes longer on a busy machine
        yield proc
    finally:
        proc.stop()


class Page:
    """A fresh browser context on the server's page, with its console errors collected."""

    def __init__(
        self, browser: Any, server: ServerProcess, key: str | None, width: int = 1400, height: int = 900
    ) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height})
        if key is not None:
            self.context.add_init_script(f"sessionStorage.setItem('conveyor.apiKey', {json.dumps(key)})")
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.goto(server.url + "/")

    def wait_ready(self) -> None:
        self.page.wait_for_function("document.getElementById('engine-state').textContent === 'ready'", timeout=WAIT_MS)

    def text(self, selector: str) -> str:
        return self.page.inner_text(selector)

    def set_settings(self, **values: Any) -> None:
        self.page.click("#settings summary")
        for name, value in values.items():
            if isinstance(value, bool):
                self.page.set_checked(f"#settings-form [name={name}]", value)
            else:
                self.page.fill(f"#settings-form [name={name}]", str(value))

    def send(self, message: str) -> None:
        self.page.fill("#chat-input", message)
        self.page.press("#chat-input", "Enter")  # keyboard submit

    def wait_reply_done(self) -> None:
        self.page.wait_for_function(
            "!document.getElementById('send').disabled && document.querySelector('.msg.assistant .note')",
            timeout=WAIT_MS,
        )

    def last_reply(self) -> str:
        return self.page.locator(".msg.assistant .body").last.inner_text()

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def open_page(browser: Any, server: ServerProcess) -> Iterator[Callable[..., Page]]:
    pages: list[Page] = []

    def make(key: str | None = KEY, **kwargs: Any) -> Page:
        pages.append(Page(browser, server, key, **kwargs))
        return pages[-1]

    yield make
    for page in pages:
        page.close()


def _api_reply(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _shot(page: Page, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.page.screenshot(path=str(Path(SCREENSHOTS) / name))


def test_page_loads_without_console_errors(open_page: Callable[..., Page]) -> None:
    page = open_page()
    page.wait_ready()
    page.page.wait_for_timeout(1500)  # a few polls of the engine view
    assert page.text("#model-name") == "SmolLM2-135M-Instruct"
    assert page.text("#t-running") == "0" and page.text("#t-waiting") == "0"
    assert re.fullmatch(r"0 / \d+", page.text("#t-kv"))
    drawn = page.page.evaluate("""() => [...document.querySelectorAll('canvas')].map((c) => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 3; i < d.length; i += 4) if (d[i]) return true;
        return false; })""")
    assert drawn and all(drawn), "every plot draws at least its axes"
    assert not page.errors, page.errors


def test_chat_streams_the_reply_the_api_gives(open_page: Callable[..., Page], server: ServerProcess) -> None:
    page = open_page()
    page.wait_ready()
    page.set_settings(temperature=0, max_tokens=40, system="You are a concise assistant.")
    page.page.evaluate("""() => { window.updates = 0; new MutationObserver(() => window.updates++).observe(
        document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    question = "What is the capital of France?"
    page.send(question)
    page.page.wait_for_function("document.getElementById('stop').disabled === false", timeout=WAIT_MS)
    page.wait_reply_done()
    shown = page.last_reply()
    expected = _api_reply(
        server,
        {
            "messages": [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": question},
            ],
            "temperature": 0,
            "max_tokens": 40,
        },
    )
    assert shown == expected["choices"][0]["message"]["content"] and shown
    assert page.page.evaluate("window.updates") >= 4, "the reply arrived in pieces (streamed), not at once"
    assert f"{expected['usage']['completion_tokens']} tokens" in page.text(".msg.assistant .note")
    assert page.text("#chat-input") == ""

    page.page.click("#regenerate")  # greedy: the same reply again, replacing the old one
    page.page.wait_for_function("document.getElementById('stop').disabled === false", timeout=WAIT_MS)
    page.wait_reply_done()
    assert page.page.locator(".msg.assistant").count() == 1 and page.last_reply() == shown

    page.page.reload()  # the conversation is kept in the browser
    page.page.wait_for_selector(".msg.assistant")
    assert [m.inner_text() for m in page.page.locator(".msg .body").all()] == [question, shown]
    assert not page.errors, page.errors


def test_per_token_view_shows_the_api_logprobs(open_page: Callable[..., Page], server: ServerProcess) -> None:
    page = open_page()
    page.wait_ready()
    page.page.click("#clear")
    page.set_settings(temperature=0, max_tokens=12, logprobs=True)
    page.send("Name a colour.")
    page.wait_reply_done()
    tokens = page.page.locator(".msg.assistant .tok")
    api = _api_reply(
        server,
        {
            "messages": [{"role": "user", "content": "Name a colour."}],
            "temperature": 0,
            "max_tokens": 12,
            "logprobs": True,
            "top_logprobs": 5,
        },
    )
    entries = api["choices"][0]["logprobs"]["content"]
    assert [t.inner_text() for t in tokens.all()] == [e["token"] for e in entries]
    # the hover text: the token and its probability, then the top alternatives. The API call above hit the
    # prefix cache (another computation shape), so in bfloat16 the numbers may differ in the last bits.
    title = [
        re.fullmatch(r'\s*(".*")  p=([0-9.]+)', line)
        for line in (tokens.first.get_attribute("title") or "").split("\n")
    ]
    assert all(title), title
    shown = {json.loads(m.group(1)): float(m.group(2)) for m in title[1:] if m}
    expected_top = {alt["token"]: math.exp(alt["logprob"]) for alt in entries[0]["top_logprobs"]}
    assert json.loads(title[0].group(1)) == entries[0]["token"]  # type: ignore[union-attr]
    assert float(title[0].group(2)) == pytest.approx(math.exp(entries[0]["logprob"]), abs=0.03)  # type: ignore[union-attr]
    assert len(shown) == 5 and len(shown.keys() & expected_top.keys()) >= 4
    for token in shown.keys() & expected_top.keys():
        assert shown[token] == pytest.approx(expected_top[token], abs=0.03)
    _shot(page, "ui-playground.png")
    assert not page.errors, page.errors


def test_stop_ends_the_request(open_page: Callable[..., Page], server: ServerProcess) -> None:
    page = open_page()
    page.wait_ready()
    page.page.click("#clear")
    page.set_settings(max_tokens=1500, temperature=1, seed=3)
    page.send("Write a very long story about a lighthouse keeper.")
    page.page.wait_for_function(
        "document.querySelector('.msg.assistant .body')?.textContent.length > 0", timeout=WAIT_MS
    )
    page.page.keyboard.press("Escape")  # Esc in the message box stops
    page.wait_reply_done()
    assert page.text(".msg.assistant .note") == "stopped"
    page.page.wait_for_function("document.getElementById('t-running').textContent === '0'", timeout=WAIT_MS)
    deadline = time.time() + 30  # blocks freed by an abort are held until the step in flight has run
    while True:
        stats = httpx.get(server.url + "/v1/engine/status", headers=AUTH).json()["stats"]
        if stats["kv_blocks"]["used"] == 0 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert stats["requests"]["in_server"] == 0 and stats["kv_blocks"]["used"] == 0


def test_engine_view_follows_a_burst(open_page: Callable[..., Page], server: ServerProcess) -> None:
    page = open_page()
    page.wait_ready()
    page.set_settings(max_tokens=48)
    page.send("Tell me about paged attention.")  # one chat reply streams in the playground meanwhile
    results: list[int] = []

    def one(i: int) -> None:
        body = {"prompt": f"Story {i}:", "max_tokens": 64, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=300) as r:
            results.append(r.status_code)
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        page.page.wait_for_function("Number(document.getElementById('t-running').textContent) > 1", timeout=WAIT_MS)
        page.page.wait_for_function("Number(document.getElementById('t-tps').textContent) > 0", timeout=WAIT_MS)
        page.page.wait_for_timeout(1500)
        _shot(page, "ui-engine-under-load.png")
    finally:
        for t in threads:
            t.join()
    assert results == [200] * 8
    page.wait_reply_done()
    page.page.wait_for_function(
        "document.getElementById('t-running').textContent === '0' && "
        "document.getElementById('t-waiting').textContent === '0'",
        timeout=WAIT_MS,
    )
    assert page.text("#t-preempted") == "0"
    assert not page.errors, page.errors


def test_wrong_api_key_shows_the_server_error(open_page: Callable[..., Page], server: ServerProcess) -> None:
    message = httpx.get(server.url + "/v1/engine/status").json()["error"]["message"]
    page = open_page(key="not-the-key")
    page.page.wait_for_selector("#key-dialog[open]", timeout=WAIT_MS)  # the first poll was refused: asked once
    assert message in page.text("#key-reason")
    page.page.click("#key-cancel")
    page.send("Hello?")
    page.page.wait_for_selector("#chat-error:not([hidden])", timeout=WAIT_MS)
    assert page.text("#chat-error") == message
    assert page.page.locator(".msg.assistant").count() == 0  # nothing came: no empty reply kept
    page.page.wait_for_selector("#key-dialog[open]")
    page.page.fill("#key-input", KEY)  # the right key, once: then everything works
    page.page.click("#key-save")
    page.wait_ready()
    page.page.click("#regenerate")
    page.wait_reply_done()
    assert page.last_reply()
    assert not page.page.locator("#key-dialog[open]").count()


def test_phone_width(open_page: Callable[..., Page]) -> None:
    page = open_page(width=390, height=844)
    page.wait_ready()
    fits = "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    assert page.page.evaluate(fits), "no sideways scrolling on a phone"
    assert page.page.is_visible("#playground") and not page.page.is_visible("#engine")
    page.page.click(".tabs button[data-view=engine]")
    assert page.page.is_visible("#engine") and not page.page.is_visible("#playground")
    page.page.wait_for_timeout(1200)
    assert page.page.evaluate(fits)
    assert not page.errors, page.errors


def test_copy_as_python_and_curl_run(open_page: Callable[..., Page], server: ServerProcess) -> None:
    page = open_page()
    page.wait_ready()
    page.page.click("#clear")
    page.set_settings(temperature=0, max_tokens=16, top_k=5, stop="\\n")
    page.page.fill("#chat-input", 'Say hello in French. It\'s "easy".')
    expected = _api_reply(
        server,
        {
            "messages": [{"role": "user", "content": 'Say hello in French. It\'s "easy".'}],
            "temperature": 0,
            "max_tokens": 16,
            "top_k": 5,
            "stop": ["\\n"],
        },
    )
    answer = expected["choices"][0]["message"]["content"]
    env = {**os.environ, "CONVEYOR_API_KEY": KEY}

    page.page.click("#copy-python")
    python = page.page.input_value("#copy-text")
    assert KEY not in python
    run = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == answer + "\n"
    page.page.keyboard.press("Escape")

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed; the Python snippet was checked")
    page.page.click("#copy-curl")
    curl = page.page.input_value("#copy-text")
    run = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["choices"][0]["message"]["content"] == answer


def test_a_refused_request_shows_the_api_message(open_page: Callable[..., Page], server: ServerProcess) -> None:
    page = open_page()
    page.wait_ready()
    page.page.click("#clear")
    page.set_settings(max_tokens=999999, temperature=0.5)
    page.send("Hi")
    page.page.wait_for_selector("#chat-error:not([hidden])", timeout=WAIT_MS)
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 999999,
            "temperature": 0.5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 400
    assert page.text("#chat-error") == r.json()["error"]["message"]
    assert "max_tokens=999999 is too large" in page.text("#chat-error")
    assert page.page.locator(".msg.assistant").count() == 0 and not page.page.is_disabled("#send")
