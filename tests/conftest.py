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
