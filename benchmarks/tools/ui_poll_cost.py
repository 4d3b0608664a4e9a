"""Does the open engine view (the web page polling /v1/engine/status) slow the engine down?

W1 through `conveyor serve`, with nothing watching, with the page's polling alone (an HTTP client asking
exactly what the page asks, as often), and with the real page open in headless chromium, interleaved round by
round on one server. W1 = 64 requests, random-token prompts of 32-256, 128 new tokens each, greedy, EOS
ignored, all 64 sent at once (streaming /v1/completions). Each round runs every arm once on the same prompts,
in a rotating order; the report gives per-run output tok/s, medians, and per-round ratios to "none".

    .venv/bin/python benchmarks/tools/ui_poll_cost.py --rounds 5 --out /tmp/ui_poll_cost.json
    .venv/bin/python benchmarks/tools/ui_poll_cost.py --endpoint-cpu     # one poll's CPU cost, in-process

The browser arm needs Playwright for Python and /usr/bin/chromium (both installed by scripts/test.sh);
without them it is left out and the report says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from conveyor.bench.serve import run_load

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
POLL_S = 0.5  # the page's poll interval (static/engine_view.js POLL_MS)
PAGE_WINDOW_S = 10  # the page's ?window= (SPANS_KEPT_S)


def poll_like_the_page(url: str) -> None:
    """Ask /v1/engine/status as the page does: every 0.5 s, only the spans since the last answer."""
    last_now: float | None = None
    with httpx.Client(timeout=10) as client:
        while True:
            query = f"?window={PAGE_WINDOW_S}" + ("" if last_now is None else f"&since={max(0.0, last_now - 0.25)}")
            last_now = client.get(url + "/v1/engine/status" + query).json()["now"]
            time.sleep(POLL_S)


def hold_page(url: str) -> None:
    """Keep the page open in headless chromium (both panes visible) until killed."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url + "/")
        page.wait_for_function("document.getElementById('engine-state').textContent === 'ready'", timeout=120_000)
        print("page open", flush=True)
        while True:
            page.wait_for_timeout(1000)


def browser_available() -> str | None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    return None if os.path.exists(CHROMIUM) else f"{CHROMIUM} is missing (apt-get install -y chromium)"


def start_watcher(arm: str, url: str) -> subprocess.Popen[str] | None:
    if arm == "none":
        return None
    mode = "--poll" if arm == "poller" else "--hold-page"
    proc = subprocess.Popen([sys.executable, __file__, mode, url], stdout=subprocess.PIPE, text=True)
    if arm == "browser":
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the page has loaded and polled once
        if line.strip() != "page open":
            raise RuntimeError("the browser did not open the page")
    time.sleep(2 * POLL_S)
    return proc


def stop_watcher(proc: subprocess.Popen[str] | None) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_server(port: int, extra: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "conveyor.cli", "serve", "--port", str(port), "--max-queued-requests", "256", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        time.sleep(0.5)
    raise TimeoutError("the server did not become healthy in 600 s")


def endpoint_cpu(polls: int = 400) -> dict[str, Any]:
    """CPU seconds one page poll costs the server process (the route, JSON and HTTP handling in-process),
    measured as process CPU time, which other programs on the machine do not inflate the way they
    inflate wall time. The engine's ring holds W1-like steps: 64 sequences per ~110 ms step, five spans
    each (schedule, prepare, commit on the host, forward+sample on the device) over the last 30 s."""
    from fastapi.testclient import TestClient

    from conveyor.config import EngineConfig
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.engine import Engine
    from conveyor.engine.stats import EngineStats
    from conveyor.runtime.timeline import DEVICE_LANE, HOST_LANE, StepTimeline
    from conveyor.server.app import build_app
    from conveyor.server.state import ServerOptions, ServerState

    class FilledEngine(AsyncEngine):  # a started engine's public surface, without loading a model
        def __init__(self) -> None:
            super().__init__(EngineConfig())
            self.engine = Engine.__new__(Engine)
            self.engine.timeline = StepTimeline()
            self._ready.set()
            self._stats = EngineStats(64, 0, 5000, 0, 0, 728, 500, 10, 0, 9000, 0, 40000, True, 500.0, 510.0)

    engine = FilledEngine()
    timeline = engine.engine.timeline
    timeline.origin -= 60.0  # as if the engine had run for a minute already
    start = time.perf_counter() - 30.0
    for step in range(int(30 / 0.11)):
        t = start + step * 0.11
        timeline.add("forward+sample", DEVICE_LANE, t, t + 0.105, step, 64, 64, 64)
        for name in ("commit", "schedule", "prepare"):
            timeline.add(name, HOST_LANE, t + 0.001, t + 0.002, step)
    since = timeline.now() - POLL_S - 0.25  # what the page asks: the last poll's spans (~7 steps here)
    client = TestClient(build_app(ServerState(engine, ServerOptions(model_name="m"))))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sizes = []
    for _ in range(polls):
        r = client.get(f"/v1/engine/status?window={PAGE_WINDOW_S}&since={since}")
        assert r.status_code == 200, r.text
        sizes.append(len(r.content))
    spans = len(r.json()["spans"])
    cpu = (time.process_time() - cpu0) / polls
    return {
        "cpu_ms_per_poll": cpu * 1e3,
        "wall_ms_per_poll": (time.perf_counter() - wall0) / polls * 1e3,
        "bytes_per_poll": statistics.median(sizes),
        "spans_per_poll": spans,
        "share_of_2_cores_at_2_polls_per_s": cpu * (1 / POLL_S) / 2,
        "note": "TestClient adds its own thread hop, so this over-counts the route's cost",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--port", type=int, default=18799)
    parser.add_argument(
        "--arms", nargs="+", default=["none", "poller", "browser"], choices=["none", "poller", "browser"]
    )
    parser.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="passed to conveyor serve (e.g. --dtype float32)"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--endpoint-cpu", action="store_true", help="only measure one poll's CPU cost in-process")
    parser.add_argument("--poll", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--hold-page", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.poll:
        poll_like_the_page(args.poll)
        return 0
    if args.hold_page:
        hold_page(args.hold_page)
        return 0
    if args.endpoint_cpu:
        print(json.dumps(endpoint_cpu(), indent=2))
        return 0

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the server too
    arms = list(args.arms)
    skipped = browser_available() if "browser" in arms else None
    if skipped:
        arms.remove("browser")
        print(f"browser arm left out: {skipped}", flush=True)
    server = start_server(args.port, args.server_args)
    url = f"http://127.0.0.1:{args.port}"
    runs: dict[str, list[float]] = {arm: [] for arm in arms}
    try:
        asyncio.run(run_load(url, 8, None, 8, (32, 64), 16, None, None, seed=99))  # warm-up, not counted
        for r in range(args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                watcher = start_watcher(arm, url)
                try:
                    result = asyncio.run(run_load(url, 64, None, 64, (32, 256), 128, None, None, seed=r))
                finally:
                    stop_watcher(watcher)
                if result["failed"]:
                    raise RuntimeError(f"{result['failed']} requests failed: {result['errors']}")
                runs[arm].append(result["output_tokens_per_s"])
                print(
                    f"round {r + 1} {arm:8s} {result['output_tokens_per_s']:7.1f} tok/s ({result['seconds']:.1f} s)",
                    flush=True,
                )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    report: dict[str, Any] = {
        "workload": "W1 through the server: 64 requests at once, prompts 32-256 random tokens, 128 new, greedy",
        "command": "python benchmarks/tools/ui_poll_cost.py " + " ".join(sys.argv[1:]),
        "server_args": args.server_args,
        "rounds": args.rounds,
        "tok_per_s": runs,
        "median_tok_per_s": {arm: statistics.median(v) for arm, v in runs.items()},
        "browser_left_out": skipped,
    }
    for arm in arms:
        if arm != "none":
            ratios = [a / b for a, b in zip(runs[arm], runs["none"])]
            report[f"{arm}_over_none"] = {"per_round": ratios, "median": statistics.median(ratios)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
