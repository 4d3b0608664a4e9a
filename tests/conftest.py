"""Shared fixtures: the embedded default model (ours and transformers'), tiny random models."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from conveyor.model.loader import default_model_path

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def default_gguf() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_gguf: str) -> Any:
    """transformers' own GGUF loading and dequantization of the default model, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def native_kernels() -> Any:
    """The compiled native CPU kernels; skipped where the machine has nothing to build them with,
    a failure wherever a build was attempted and failed."""
    from conveyor.model.native import NoToolchain, load_kernels

    try:
        return load_kernels()
    except NoToolchain as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def default_llm() -> Any:
    """The embedded model in float32 (transformers' own GGUF loading, the reference, is float32)."""
    from conveyor import LLM

    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)  # the transformers reference is float32


FULL_TIER_ONLY = (
    # Whole-model parity against transformers, every family, kernel builds, process-level CLI runs.
    "tests/model/test_parity_default.py",
    "tests/model/test_parity_bf16.py",
    "tests/model/test_model_families.py",
    "tests/model/test_native_build.py",
    "tests/model/test_kernel_background_build.py::test_auto_with_an_empty_cache",
    # The fuzzer's seeded hundred mutants (the fast tier keeps the regression test of each finding).
    "tests/fuzz/test_fuzz.py",
    "tests/model/test_isa.py::test_kernel_tests_pass_at_a_forced_lower_tier",
    "tests/model/test_isa.py::test_the_portable_tier_compiles_for_arm64",
    "tests/model/test_quant.py::test_default_model_int4_",
    "tests/model/test_config_and_loader.py::test_gguf_tokenizer_cache_round_trip",
    "tests/test_cli.py",
    "tests/test_host_memory.py",
    "tests/test_openmp.py",
    # Benchmarks run end to end through the CLI.
    "tests/bench/test_bench.py::test_throughput_cli",
    "tests/bench/test_bench.py::test_decode_step",
    "tests/bench/test_bench.py::test_latency_cli",
    "tests/bench/test_bench.py::test_a_peer_that_cannot_run",
    "tests/bench/test_bench.py::test_llama_cpp_peer_reads_gguf_only_and_batches_when_installed",
    # Servers in child processes (the fast tier keeps the in-process API and UI checks).
    "tests/server/test_server.py",
    "tests/server/test_server_errors.py",
    "tests/server/test_server_tools.py",
    "tests/server/test_server_shutdown.py",
    "tests/server/test_vllm_compat.py",
    "tests/server/test_ui_browser.py",
    "tests/server/test_ui_api.py",
    # The default model under preemption, multi-step plans and logprobs against transformers.
    "tests/engine/test_logprobs.py",
    "tests/engine/test_async_batching.py::test_default_model_async_matches_sync_under_preemption",
    "tests/engine/test_multi_step.py",
    "tests/engine/test_llm_api.py",
    "tests/model/test_memory.py",
    "tests/core/test_prefix_cache.py::test_shared_prefix_hits_and_matches_cold_run",
    # Worker processes and Ray replicas.
    "tests/tensor_parallel/test_tensor_parallel.py::test_tp2_",
    "tests/tensor_parallel/test_tensor_parallel.py::test_server_",
    "tests/tensor_parallel/test_tensor_parallel.py::test_workers_die",
    "tests/tensor_parallel/test_tensor_parallel.py::test_a_dead_worker",
    "tests/tensor_parallel/test_tensor_parallel.py::test_int4_shards",
    "tests/tensor_parallel/test_tensor_parallel.py::test_structured_output_is_refused",
    "tests/data_parallel/test_data_parallel_server.py",
    "tests/data_parallel/test_data_parallel.py::test_dp2_",
)
"""Tests only the full tier runs (`bash scripts/test.sh`): each takes seconds to minutes (a whole model against
transformers, a server or worker process, a CLI run). The fast tier (`bash scripts/test.sh --fast`) runs the rest,
which still covers every package; a node id here is a prefix of the ids it marks."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(FULL_TIER_ONLY):
            item.add_marker(pytest.mark.full)
