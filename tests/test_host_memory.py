"""After an engine on the CPU is built, a freed activation-sized block is reused without new page faults (glibc's
default unmapped every block over 32 MiB on free, so each step's large activations faulted in fresh zeroed pages);
a malloc setting in the environment is left as given. Each case runs in a fresh interpreter: the setting is
process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.tiny_models import build_tiny_model

ROOT = str(Path(__file__).resolve().parents[1])

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the setting is glibc's malloc's"
)

_CODE = """
import json, resource, sys
import conveyor, torch
from conveyor.host_memory import why_left_alone
llm = conveyor.LLM(model=sys.argv[1], dtype="float32", max_model_len=64, kv_cache_memory="1MiB")
def faults_of_a_fresh_block() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page written
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del block
    return after - before
first = faults_of_a_fresh_block()
print(json.dumps({"first": first, "second": faults_of_a_fresh_block(), "left_alone": why_left_alone()}))
"""


def _run_fresh(code: str, model: str, environ: dict[str, str]) -> dict:
    """`code` run with the model's path in a fresh interpreter; the JSON object its last line prints."""
    done = subprocess.run(
        [sys.executable, "-c", code, model],
        capture_output=True,
        text=True,
        timeout=300,
        env={**environ, "PYTHONPATH": ROOT},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _faults(model: str, **env: str) -> dict:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "CONVEYOR_KEEP_FREED_MEMORY")
    }
    return _run_fresh(_CODE, model, {**environ, **env})


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny_model("llama", path)
    return path


def test_a_freed_block_is_reused_without_page_faults(tiny_model: str) -> None:
    faults = _faults(tiny_model)
    assert faults["left_alone"] is None
    # 16384 pages of 4 KiB written for the first time (fewer where transparent huge pages back the heap), then the
    # same pages again (glibc's default unmapped the block on free and faulted in fresh ones)
    assert faults["first"] >= 16 and faults["second"] <= faults["first"] // 10, faults


def test_conveyor_keep_freed_memory_0_leaves_glibc_as_it_is(tiny_model: str) -> None:
    faults = _faults(tiny_model, CONVEYOR_KEEP_FREED_MEMORY="0")
    assert faults["left_alone"] == "CONVEYOR_KEEP_FREED_MEMORY=0"
    assert faults["first"] >= 16 and faults["second"] >= faults["first"] // 2, faults  # a fresh mapping per block


def test_a_malloc_setting_in_the_environment_is_kept(tiny_model: str) -> None:
    faults = _faults(tiny_model, MALLOC_MMAP_MAX_="65536")
    assert faults["left_alone"] == "the environment tunes glibc's malloc (MALLOC_MMAP_MAX_)"
    assert faults["first"] >= 16 and faults["second"] >= faults["first"] // 2, faults  # a fresh mapping per block


def _huge_pages_setting() -> str | None:
    """The bracketed choice in /sys/kernel/mm/transparent_hugepage/enabled (None where the file is absent)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


_HUGE_CODE = """
import json, sys
import conveyor
llm = conveyor.LLM(model=sys.argv[1], dtype="float32", max_model_len=64, kv_cache_memory="64MiB")
cache = llm.engine.runner.kv_caches[0][0]
start, end = cache.data_ptr(), cache.data_ptr() + cache.numel() * cache.element_size()
huge = 0
region = None
for line in open("/proc/self/smaps"):
    head = line.split()
    if "-" in head[0] and len(head) >= 5:
        low, high = (int(v, 16) for v in head[0].split("-"))
        region = low < end and start < high  # madvise splits the mapping: every part that overlaps
    elif region and head[0] == "AnonHugePages:":
        huge += int(head[1])
print(json.dumps({"huge_kib": huge, "cache_kib": (end - start) >> 10}))
"""


@pytest.mark.skipif(
    _huge_pages_setting() not in ("always", "madvise"), reason="transparent huge pages are off on this machine"
)
def test_the_kv_cache_sits_on_huge_pages(tiny_model: str) -> None:
    """The KV cache is advised onto transparent huge pages before it is zeroed: its mapping holds some (with
    "madvise", only advised memory gets them; the kernel may still fall short where memory is fragmented)."""
    found = _run_fresh(_HUGE_CODE, tiny_model, dict(os.environ))
    assert found["cache_kib"] >= 4096 and found["huge_kib"] >= 2048, found
