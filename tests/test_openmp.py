"""`import conveyor` makes torch's OpenMP threads spin only briefly between parallel regions (with libgomp's
default they spin-waited on cores shared with other busy processes: 16-54 s for a request that took 3.5-6.2 s
with the short spin).
libgomp prints the settings it runs with when OMP_DISPLAY_ENV=VERBOSE, so this reads them from the source."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])


def _libgomp_settings(code: str, **env: str) -> tuple[dict[str, str], str]:
    """Run `code` in a fresh interpreter -> (the settings libgomp printed, stderr)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    environ.update(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environ)
    assert done.returncode == 0, done.stderr[-2000:]
    settings = dict(re.findall(r"^\s+(\w+) = '([^']*)'", done.stderr, re.MULTILINE))
    if "GOMP_SPINCOUNT" not in settings:
        pytest.skip("torch's OpenMP runtime is not GNU libgomp here (it printed no GOMP_SPINCOUNT)")
    return settings, done.stdout + done.stderr


def test_import_conveyor_first_sets_a_short_spin_for_this_process_only() -> None:
    settings, out = _libgomp_settings("import os, conveyor; print('left in environ:', 'GOMP_SPINCOUNT' in os.environ)")
    assert settings["GOMP_SPINCOUNT"] == "10000"
    assert "left in environ: False" in out  # processes Conveyor starts get the environment they were given


def test_a_setting_in_the_environment_is_kept() -> None:
    settings, _ = _libgomp_settings("import conveyor", GOMP_SPINCOUNT="12345")
    assert settings["GOMP_SPINCOUNT"] == "12345"
    settings, _ = _libgomp_settings("import conveyor", OMP_WAIT_POLICY="PASSIVE")
    assert settings["GOMP_SPINCOUNT"] == "0"


def test_torch_imported_first_is_too_late_and_the_engine_says_so(tmp_path: Path) -> None:
    from helpers.tiny_models import build_tiny_model

    build_tiny_model("llama", str(tmp_path))
    code = (
        "import torch, conveyor\n"
        f"conveyor.LLM(model={str(tmp_path)!r}, dtype='float32', max_model_len=64, kv_cache_memory='1MiB')"
    )
    settings, out = _libgomp_settings(code)
    assert settings["GOMP_SPINCOUNT"] == "300000"  # libgomp's default: spin first
    assert "torch was imported before conveyor" in out and "GOMP_SPINCOUNT=10000" in out
