"""Async against sync batching, alternating runs in one process; medians, idle fractions, identity check."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from conveyor.bench.workloads import Workload, random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine

WORKLOADS = {
    "a: 8 concurrent x 128 new": dict(num_requests=8, input_len=(128, 128), output_len=(128, 128)),
    "b: 64 requests x 128 new": dict(num_requests=64, input_len=(32, 256), output_len=(128, 128)),
}


@dataclass
class RunResult:
    mode: str
    seconds: float
    output_tokens: int
    device_idle_fraction: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_once(engine: Engine, workload: Workload) -> tuple[RunResult, list[list[int]]]:
    before = engine.stats()
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(workload.prompts, workload.params)]
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    after = engine.stats()
    busy = after.device_busy_s - before.device_busy_s
    active = after.active_s - before.active_s
    engine.check_idle()
    mode = "async" if engine.async_batching else "sync"
    return (
        RunResult(mode, seconds, sum(len(t) for t in tokens.values()), max(0.0, 1 - busy / active)),
        [tokens[i] for i in ids],
    )


def compare(
    config: EngineConfig,
    runs: int = 5,
    trace_path: str | None = None,
    workloads: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    engines = {mode: Engine(config.replace(async_batching=mode == "async")) for mode in ("sync", "async")}
    vocab = engines["sync"].spec.vocab_size
    report: dict[str, Any] = {"machine": machine_facts(), "config": _config_dict(config), "runs": runs, "workloads": {}}
    for name, shape in (workloads or WORKLOADS).items():
        workload = random_workload(vocab_size=vocab, name=name, **shape)
        for engine in engines.values():  # warm-up, and the identity check: greedy tokens must agree
            engine.step()
        warm = {mode: run_once(engines[mode], workload)[1] for mode in engines}
        results: dict[str, list[RunResult]] = {"sync": [], "async": []}
        for i in range(runs):
            for mode in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
                results[mode].append(run_once(engines[mode], workload)[0])
        if trace_path:
            engines["async"].start_trace()
            run_once(engines["async"], workload)
            engines["async"].save_trace(trace_path.replace(".json", f"-{name.split(':')[0]}-async.json"))
            engines["async"].tracer.enabled = False
        med = {m: statistics.median(r.tokens_per_s for r in rs) for m, rs in results.items()}
        report["workloads"][name] = {
            "num_requests": len(workload.prompts),
            "output_tokens": workload.num_output_tokens,
            "identical_tokens": warm["sync"] == warm["async"],
            "median_tokens_per_s": med,
            "speedup_async_over_sync": med["async"] / med["sync"],
            # The i-th async run over the i-th sync run (adjacent in time): steadier than the ratio of medians
            # when the machine's speed drifts during the benchmark.
            "pair_ratios": [a.tokens_per_s / s.tokens_per_s for a, s in zip(results["async"], results["sync"])],
            "median_device_idle_fraction": {
                m: statistics.median(r.device_idle_fraction for r in rs) for m, rs in results.items()
            },
            "runs": {m: [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rs] for m, rs in results.items()},
        }
    for engine in engines.values():
        engine.close()
    return report


def machine_facts() -> dict[str, Any]:
    from conveyor.model import isa

    cpu, flags = isa.cpu_facts()
    return {
        "cpu": cpu,
        "isa": sorted(f for f in flags if f.startswith(("amx", "avx512", "avx2", "avx_vnni", "fma"))),
        "kernel_tier": isa.requested_tier(flags),
        "cpu_best_tier": isa.cpu_tier(flags),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        # the machines are shared: the load when the result was taken says how far to trust it
        "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _config_dict(config: EngineConfig) -> dict[str, Any]:
    return {k: v for k, v in asdict(config).items() if k != "async_batching"}


def markdown_table(report: dict[str, Any]) -> str:
    lines = [
        "| workload | sync tok/s | async tok/s | async / sync | median pair ratio (range) | device idle sync | "
        "device idle async | identical tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, w in report["workloads"].items():
        med, idle, pairs = w["median_tokens_per_s"], w["median_device_idle_fraction"], w["pair_ratios"]
        lines.append(
            f"| {name} | {med['sync']:.1f} | {med['async']:.1f} | {w['speedup_async_over_sync']:.3f}x | "
            f"{statistics.median(pairs):.3f}x ({min(pairs):.2f}-{max(pairs):.2f}) | "
            f"{idle['sync']:.1%} | {idle['async']:.1%} | {w['identical_tokens']} |"
        )
    return "\n".join(lines)


def save(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
