"""The bench tooling: workloads, baselines, plots and the CLI end to end on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from conveyor import ConfigError
from conveyor.bench.results import load_baseline, plot_serve, plot_throughput, save_baseline
from conveyor.bench.workloads import random_workload, shared_prefix_workload
from helpers import REPO_ROOT
from helpers.tiny_models import build_tiny_model


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
    paths = plot_serve(
        [{"concurrency": 1, "output_tokens_per_s": 10.0}, {"concurrency": 8, "output_tokens_per_s": 50.0}],
        {1: [0.1, 0.2, 0.3], 8: [0.5, 0.7]},
        str(tmp_path / "serve"),
    )
    for path in [bar, *paths]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cli_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The `conveyor bench` lines of this module's collected CLI tests, run together in one child interpreter
    (tests/helpers/run_cli.py: conveyor.cli.main as the console script calls it, each line in its test's own
    folder, with its own environment, stdout, stderr and exit status) -> {test's group: (folder, results)}."""
    groups = {
        "throughput": ("test_throughput_cli_with_peer_baseline_and_compare", _throughput_lines),
        "decode-step": ("test_decode_step_counts_flops_from_the_model_shape", _decode_step_lines),
        "latency": ("test_latency_cli_interleaves_ours_and_the_peer", _latency_lines),
        "failing-peer": ("test_a_peer_that_cannot_run_costs_only_its_own_row", _failing_peer_lines),
    }
    collected = {
        getattr(item, "originalname", item.name) for item in request.session.items if item.module is request.module
    }
    folders = {group: tmp_path_factory.mktemp(group) for group, (test, _) in groups.items() if test in collected}
    lines = {group: groups[group][1](folder) for group, folder in folders.items()}
    runs = [line for group_lines in lines.values() for line in group_lines]
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "helpers" / "run_cli.py")],
        input=json.dumps(runs),
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    results = iter([json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")])
    found = {
        group: (folders[group], [next(results, None) for _ in group_lines]) for group, group_lines in lines.items()
    }
    assert all(r is not None for _, rs in found.values() for r in rs), (
        f"the CLI runner stopped early:\n{done.stderr[-3000:]}"
    )
    return found


def _throughput_lines(tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder)
    cmd = [
        "bench",
        "throughput",
        "--model",
        folder,
        "--num-prompts",
        "6",
        "--input-len",
        "4:12",
        "--output-len",
        "5",
        "--kv-cache-memory",
        "1MiB",
        "--max-model-len",
        "64",
        "--results-dir",
        str(tmp_path / "results"),
        "--peer",
        "hf-generate",
        "--peer-batch-size",
        "4",
        "--plot",
        str(tmp_path / "bars.png"),
    ]
    return [
        {"argv": [*cmd, "--save-baseline", "tiny-test"], "cwd": str(tmp_path)},
        {"argv": [*cmd, "--compare-to", "tiny-test"], "cwd": str(tmp_path)},
        {"argv": [*cmd, "--compare-to", "nope"], "cwd": str(tmp_path)},
    ]


def test_throughput_cli_with_peer_baseline_and_compare(cli_runs: dict[str, Any]) -> None:
    tmp_path, (first, second, missing) = cli_runs["throughput"]
    assert first["rc"] == 0, first["stderr"]
    result = json.loads(first["stdout"][: first["stdout"].rindex("}") + 1])
    assert result["output_tokens_per_s"] > 0 and result["workload"]["output_tokens"] == 30
    assert result["peers"]["hf-generate"]["output_tokens"] == 30
    assert os.path.isfile(tmp_path / "benchmarks" / "baselines" / "tiny-test.json")
    assert os.listdir(tmp_path / "results")
    assert second["rc"] == 0 and "vs baseline 'tiny-test'" in second["stdout"]
    assert missing["rc"] == 2 and "tiny-test" in missing["stderr"] and "Traceback" not in missing["stderr"]


def _decode_step_lines(tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder)
    argv = [
        "bench",
        "decode-step",
        "--model",
        folder,
        "--num-seqs",
        "2",
        "--prompt-len",
        "5",
        "--steps",
        "3",
        "--kv-cache-memory",
        "1MiB",
        "--max-model-len",
        "64",
        "--dtype",
        "float32",
        "--results-dir",
        str(tmp_path / "r"),
    ]
    return [{"argv": argv, "cwd": str(tmp_path)}]


def test_decode_step_counts_flops_from_the_model_shape(
    cli_runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from conveyor.bench import decode_step
    from conveyor.bench.decode_step import attention_flops, linear_flops_per_token, measure_decode_step
    from conveyor.config import EngineConfig
    from conveyor.model.loader import load_model

    # The in-process runs check the arithmetic from the model shape, which holds at any measurement size: their
    # copy and matmul ceilings are measured on small buffers (the CLI line measures at the defaults).
    copy, peak = decode_step.copy_bandwidth_gbs, decode_step.matmul_peak_gflops
    monkeypatch.setattr(decode_step, "copy_bandwidth_gbs", lambda: copy(nbytes=2**24))
    monkeypatch.setattr(decode_step, "matmul_peak_gflops", lambda dtype: peak(dtype, size=256))
    tmp_path, (cli,) = cli_runs["decode-step"]
    folder = str(tmp_path / "tiny")  # hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads of 16, vocab 512
    config = EngineConfig(model=folder, kv_cache_memory="1MiB", max_model_len=64)
    result = measure_decode_step(config, num_seqs=3, prompt_len=10, steps=4)
    spec = load_model(folder, "float32").spec
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    assert linear_flops_per_token(spec) == 2 * (2 * per_layer + 64 * 512)
    assert attention_flops(spec, 12) == 4 * 2 * 4 * 16 * 12
    expected = 3 * (linear_flops_per_token(spec) + attention_flops(spec, 10 + 1 + 4 // 2))
    assert result["gflop_per_step"] == pytest.approx(expected / 1e9)
    assert len(result["step_ms_all"]) == 4
    parts = result["host_ms_per_step_parts"]  # the host's share: plan, tensors, commit; each measured
    assert set(parts) == {"schedule", "prepare", "commit"} and all(ms > 0 for ms in parts.values())
    assert result["host_ms_per_step"] == pytest.approx(sum(parts.values()))
    assert result["share_of_peak"] == pytest.approx(result["achieved_gflops"] / result["matmul_peak_gflops"])
    assert result["dtype"] == "float32" and result["float32_matmul_peak_gflops"] == result["matmul_peak_gflops"]
    assert result["share_of_float32_peak"] == result["share_of_peak"]
    assert result["weight_bytes_per_step"] == (2 * per_layer + 64 * 512) * 4  # every linear weight, float32
    assert result["bandwidth_bound_ms"] == pytest.approx(
        result["weight_bytes_per_step"] / result["copy_bandwidth_gbs"] / 1e6
    )
    assert result["step_over_bandwidth_bound"] == pytest.approx(result["step_ms_median"] / result["bandwidth_bound_ms"])
    assert cli["rc"] == 0, cli["stderr"]
    printed = json.loads(cli["stdout"][: cli["stdout"].rindex("}") + 1])
    assert printed["num_seqs"] == 2 and printed["dtype"] == "float32" and printed["steps"] == 3
    bf16 = measure_decode_step(dataclasses.replace(config, dtype="bfloat16"), num_seqs=2, prompt_len=5, steps=2)
    assert bf16["dtype"] == "bfloat16" and bf16["float32_matmul_peak_gflops"] > 0
    assert bf16["share_of_float32_peak"] == pytest.approx(bf16["achieved_gflops"] / bf16["float32_matmul_peak_gflops"])


def test_llama_cpp_peer_reads_gguf_only_and_batches_when_installed(tmp_path: Any, default_gguf: str) -> None:
    from conveyor.bench.peers import check_peer

    assert "GGUF" in (check_peer("llama-cpp", str(tmp_path / "hf-folder")) or "")
    reason = check_peer("llama-cpp", default_gguf)
    if reason is not None:
        assert "scripts/install_llama_cpp.sh" in reason
        pytest.skip(reason)
    from conveyor.bench.llama_cpp_peer import run_workload

    workload = random_workload(5, (3, 40), (2, 9), 49152, seed=3)
    seconds, produced = run_workload(default_gguf, workload, threads=2, max_seqs=2)  # slots are reused
    assert seconds > 0 and produced == workload.num_output_tokens


def test_openvino_peer_computes_our_tokens_when_installed(tmp_path: Any) -> None:
    """OpenVINO GenAI on the IR exported from the same checkpoint gives our greedy tokens (float32, tiny model),
    so its speed is measured on the same computation; skipped where scripts/install_openvino.sh was not run."""
    from conveyor import LLM, SamplingParams
    from conveyor.bench.openvino_peer import OpenVINOPipeline, unavailable
    from conveyor.bench.peers import check_peer

    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder)
    reason = check_peer("openvino", folder)
    assert reason == unavailable(folder)
    if reason is not None:
        assert "scripts/install_openvino.sh" in reason
        pytest.skip(reason)
    workload = random_workload(5, (3, 30), (3, 9), 512, seed=5)
    wants = [p.max_tokens for p in workload.params]
    llm = LLM(folder, dtype="float32", kv_cache_memory="1MiB", max_model_len=64)
    ours = [
        o.outputs[0].token_ids
        for o in llm.generate(
            workload.prompts,
            [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in wants],
            use_tqdm=False,
        )
    ]
    pipeline = OpenVINOPipeline(
        folder, "float32", threads=2, max_num_seqs=2, max_num_batched_tokens=16, kv_tokens=2 * 64
    )  # 2 at a time, prompts in chunks: its scheduler at work
    assert pipeline.generate(workload.prompts, wants) == ours


def _failing_peer_lines(tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder, num_hidden_layers=1)  # never exported: no cached IR to fall back on
    argv = [
        "bench",
        "throughput",
        "--model",
        folder,
        "--num-prompts",
        "3",
        "--input-len",
        "4:8",
        "--output-len",
        "3",
        "--kv-cache-memory",
        "1MiB",
        "--max-model-len",
        "64",
        "--results-dir",
        str(tmp_path / "results"),
        "--peer",
        "openvino",
        "hf-generate",
    ]
    return [{"argv": argv, "cwd": str(tmp_path), "env": {"CONVEYOR_OPENVINO_EXPORTER": "/bin/false"}}]


def test_a_peer_that_cannot_run_costs_only_its_own_row(cli_runs: dict[str, Any]) -> None:
    """OpenVINO with an IR exporter that fails (or not installed at all): our result and the other peer's are
    still measured and saved; the peer's row says why it has no number."""
    _, (done,) = cli_runs["failing-peer"]
    assert done["rc"] == 0, done["stderr"]
    result = json.loads(done["stdout"][: done["stdout"].rindex("}") + 1])
    assert result["output_tokens_per_s"] > 0 and result["peers"]["hf-generate"]["output_tokens"] == 9
    row = result["peers"]["openvino"]
    if "skipped" in row:
        assert "scripts/install_openvino.sh" in row["skipped"]
    else:
        assert "failed" in row and "optimum_cli" in row["failed"] and "[peer openvino failed" in done["stderr"]
    assert "Traceback" not in done["stderr"]


def _latency_lines(tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder)
    cmd = [
        "bench",
        "latency",
        "--model",
        folder,
        "--input-len",
        "9",
        "--output-len",
        "6",
        "--runs",
        "3",
        "--kv-cache-memory",
        "1MiB",
        "--max-model-len",
        "64",
        "--results-dir",
        str(tmp_path / "results"),
        "--peer",
        "hf-generate",
    ]
    return [{"argv": cmd, "cwd": str(tmp_path)}, {"argv": [*cmd[:-2], "--output-len", "1"], "cwd": str(tmp_path)}]


def test_latency_cli_interleaves_ours_and_the_peer(cli_runs: dict[str, Any]) -> None:
    _, (done, too_short) = cli_runs["latency"]
    assert done["rc"] == 0, done["stderr"]
    result = json.loads(done["stdout"][: done["stdout"].rindex("}") + 1])
    for measured in (result, result["peers"]["hf-generate"]):
        assert len(measured["ttft_runs_s"]) == 3 and len(measured["tpot_runs_s"]) == 3
        assert measured["ttft_s"] == sorted(measured["ttft_runs_s"])[1] and measured["tpot_s"] > 0
    assert too_short["rc"] == 2 and "--output-len must be at least 2" in too_short["stderr"]
    assert "Traceback" not in too_short["stderr"]


def test_async_vs_sync_report_on_a_tiny_model(tmp_path: Any) -> None:
    from conveyor.bench.async_compare import compare, markdown_table
    from conveyor.config import EngineConfig

    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder)
    config = EngineConfig(model=folder, kv_cache_memory="1MiB", max_model_len=64)
    workload = {"tiny: 3 x 6 new": dict(num_requests=3, input_len=(5, 9), output_len=(6, 6))}
    report = compare(config, runs=3, workloads=workload)
    w = report["workloads"]["tiny: 3 x 6 new"]
    assert w["identical_tokens"] is True and w["output_tokens"] == 18
    assert [len(w["runs"][m]) for m in ("sync", "async")] == [3, 3]
    assert all(r["output_tokens"] == 18 for m in ("sync", "async") for r in w["runs"][m])
    expected = [a["tokens_per_s"] / s["tokens_per_s"] for a, s in zip(w["runs"]["async"], w["runs"]["sync"])]
    assert w["pair_ratios"] == expected
    assert "tiny: 3 x 6 new" in markdown_table(report)
