"""The bench tooling: workloads, baselines, plots and the CLI end to end on a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from conftest import build_tiny_model

from conveyor import ConfigError
from conveyor.bench.results import load_baseline, plot_serve, plot_throughput, save_baseline
from conveyor.bench.workloads import random_workload, shared_prefix_workload


def test_workloads_are_seeded_and_shaped() -> None:
    a = random_workload(10, (5, 9), (3, 4), 1000, seed=3)
    b = random_workload(10, (5, 9), (3, 4), 1000, seed=3)
    assert a.prompts == b.prompts and all(5 <= len(p) <= 9 for p in a.prompts)
    assert all(p.ignore_eos and 3 <= (p.max_tokens or 0) <= 4 for p in a.params)
    shared = shared_prefix_workload(4, 32, (2, 3), (1, 1), 1000)
    assert len({tuple(p[:32]) for p in shared.prompts}) == 1


def test_unknown_baseline_lists_the_existing_ones(tmp_path: Any) -> None:
    save_baseline({"output_tokens_per_s": 10.0}, "alpha", str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_baseline("beta", str(tmp_path))
    assert "'beta'" in str(info.value) and "alpha" in str(info.value)
    assert load_baseline("alpha", str(tmp_path))["output_tokens_per_s"] == 10.0


def test_plots_are_written(tmp_path: Any) -> None:
    bar = plot_throughput({"conveyor": 200.0, "hf-generate": 135.0}, str(tmp_path / "bars.png"), "W1")
    paths = plot_serve([{"concurrency": 1, "output_tokens_per_s": 10.0}, {"concurrency": 8, "output_tokens_per_s": 50.0}],
                       {1: [0.1, 0.2, 0.3], 8: [0.5, 0.7]}, str(tmp_path / "serve"))
    for path in [bar, *paths]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_throughput_cli_with_peer_baseline_and_compare(tmp_path: Any) -> None:
    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder)
    cmd = [sys.executable, "-m", "conveyor.cli", "bench", "throughput", "--model", folder, "--num-prompts", "6",
           "--input-len", "4:12", "--output-len", "5", "--kv-cache-memory", "1MiB", "--max-model-len", "64",
           "--results-dir", str(tmp_path / "results"), "--peer", "hf-generate", "--peer-batch-size", "4",
           "--plot", str(tmp_path / "bars.png")]
    env = {**os.environ}
    first = subprocess.run(cmd + ["--save-baseline", "tiny-test"], capture_output=True, text=True, timeout=300,
                           env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout[:first.stdout.rindex("}") + 1])
    assert result["output_tokens_per_s"] > 0 and result["workload"]["output_tokens"] == 30
    assert result["peers"]["hf-generate"]["output_tokens"] == 30
    assert os.path.isfile(tmp_path / "benchmarks" / "baselines" / "tiny-test.json")
    assert os.listdir(tmp_path / "results")
    second = subprocess.run(cmd + ["--compare-to", "tiny-test"], capture_output=True, text=True, timeout=300,
                            env=env, cwd=tmp_path)
    assert second.returncode == 0 and "vs baseline 'tiny-test'" in second.stdout
    missing = subprocess.run(cmd + ["--compare-to", "nope"], capture_output=True, text=True, timeout=300, env=env,
                             cwd=tmp_path)
    assert missing.returncode == 2 and "tiny-test" in missing.stderr and "Traceback" not in missing.stderr
