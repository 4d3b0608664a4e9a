"""CUDA paths (streams, events, pinned buffers): run when a GPU is present, skip cleanly otherwise."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from conveyor import LLM, SamplingParams
from helpers.tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: Any) -> tuple[str, Any]:
    folder = str(tmp_path_factory.mktemp("tiny-llama-cuda"))
    return folder, build_tiny_model("llama", folder)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(1, 60))] for _ in range(12)]


@pytest.mark.parametrize(
    "pressure",
    [
        dict(kv_cache_memory=2**20),
        dict(kv_cache_memory=26 * 4 * 512, max_model_len=96),
        dict(kv_cache_memory=2**20, max_num_batched_tokens=12),
    ],
)
def test_cuda_async_matches_cpu_sync(tiny: tuple[str, Any], pressure: dict[str, Any]) -> None:
    folder, _ = tiny
    options = dict(block_size=4, max_model_len=128) | pressure
    params = [
        SamplingParams(
            max_tokens=16,
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            ignore_eos=True,
            repetition_penalty=1.2 if i % 3 == 0 else 1.0,
        )
        for i in range(12)
    ]
    results = {}
    for name, device, async_batching in (
        ("cpu-sync", "cpu", False),
        ("cuda-sync", "cuda", False),
        ("cuda-async", "cuda", True),
    ):
        llm = LLM(model=folder, device=device, async_batching=async_batching, **options)
        results[name] = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
        llm.engine.check_idle()
        llm.engine.close()
    assert results["cuda-async"] == results["cuda-sync"]
    agree = sum(a == b for a, b in zip(results["cuda-sync"], results["cpu-sync"]))
    assert agree >= 10, f"only {agree}/12 sequences agree between CUDA and CPU"


def test_cuda_greedy_matches_transformers(tiny: tuple[str, Any]) -> None:
    folder, hf_model = tiny
    llm = LLM(model=folder, device="cuda", block_size=4, max_model_len=128, kv_cache_memory=2**20)
    prompts = _prompts()[:6]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=-1, pad_token_id=0
            )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
