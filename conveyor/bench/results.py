"""Benchmark results on disk: a results folder, named baselines, comparisons and PNG plots."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from conveyor.errors import ConfigError

BASELINE_DIR = os.path.join("benchmarks", "baselines")


def save_result(result: dict[str, Any], results_dir: str, kind: str) -> str:
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def save_baseline(result: dict[str, Any], name: str, directory: str = BASELINE_DIR) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"baseline name {name!r} is not a plain name; use letters, digits, '-' or '_'")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def load_baseline(name: str, directory: str = BASELINE_DIR) -> dict[str, Any]:
    path = os.path.join(directory, f"{name}.json")
    if not os.path.isfile(path):
        existing = (
            sorted(f[:-5] for f in os.listdir(directory) if f.endswith(".json")) if os.path.isdir(directory) else []
        )
        raise ConfigError(
            f"no baseline named {name!r} in {directory}; existing baselines: "
            f"{', '.join(existing) if existing else '(none yet; make one with --save-baseline NAME)'}"
        )
    with open(path) as f:
        return json.load(f)


def compare_line(current: dict[str, Any], baseline: dict[str, Any], name: str) -> str:
    now, then = current["output_tokens_per_s"], baseline["output_tokens_per_s"]
    return f"vs baseline {name!r}: {now:.1f} / {then:.1f} output tok/s = {now / then:.3f}x"


def plot_throughput(bars: dict[str, float], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(bars)
    ax.bar(names, [bars[n] for n in names], color=["#2b6cb0"] + ["#a0aec0"] * (len(names) - 1))
    for i, n in enumerate(names):
        ax.text(i, bars[n], f"{bars[n]:.0f}", ha="center", va="bottom")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_serve(results: list[dict[str, Any]], latencies: dict[int, list[float]], prefix: str) -> list[str]:
    """Throughput against concurrency, and a CDF of end-to-end latency per concurrency level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["concurrency"] for r in results], [r["output_tokens_per_s"] for r in results], marker="o")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput against concurrency")
    fig.tight_layout()
    fig.savefig(prefix + "-throughput.png", dpi=110)
    plt.close(fig)
    paths.append(prefix + "-throughput.png")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for level, values in latencies.items():
        if values:
            ordered = sorted(values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=f"{level} clients")
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("latency CDF")
    ax.legend()
    fig.tight_layout()
    fig.savefig(prefix + "-latency-cdf.png", dpi=110)
    plt.close(fig)
    paths.append(prefix + "-latency-cdf.png")
    return paths
