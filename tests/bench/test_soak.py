"""`conveyor bench soak` end to end, briefly: a `conveyor serve` of the embedded model under 8 clients for 20 s of
mixed well-formed and malformed requests, 3000-token prompts included. The slow tier (the fast tier runs the same
client mix for a few seconds against a tiny model: tests/server/test_server_hardening.py); the acceptance run is
48 clients for 10 minutes (docs/server.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest


@pytest.mark.slow
def test_a_brief_soak_of_the_default_model_passes(tmp_path: Any) -> None:
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "conveyor.cli", "bench", "soak", "--clients", "8", "--duration", "20"]
    command += ["--out", str(out), "--server-log", str(tmp_path / "server.log")]
    command += ["--rss-bound-mib", "512"]  # 20 s may end before the working set is reached: see the 10-minute run
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "server.log").read_text()[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["server_errors_5xx"] == 0 and report["lost"] == 0
    assert report["idle_at_end"] and report["greedy_identical"] and report["server_exit_code"] == 0
    assert report["malformed"] > 0 and "long" in report["by_kind"] and "bad:oversized" in report["by_kind"]
