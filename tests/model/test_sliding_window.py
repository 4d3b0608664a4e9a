"""Sliding-window attention in the paged cache (Mistral: every layer; Qwen2: some layers): the same tokens as
transformers on prompts several windows long, and the blocks behind the window freed while a request runs."""

from __future__ import annotations

import random
from typing import Any

import pytest

from conveyor import LLM, SamplingParams
from helpers.parity import compare, hf_greedy
from helpers.tiny_models import build_tiny_model

WINDOW = 16
BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=4 * WINDOW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: Any) -> tuple[str, Any]:
    folder = str(tmp_path_factory.mktemp("mistral-window"))
    return folder, build_tiny_model("mistral", folder, sliding_window=WINDOW)


def _prompts(lengths: tuple[int, ...], seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("async_batching", [False, True])
def test_blocks_behind_the_window_are_freed_during_a_long_generation(
    mistral: tuple[str, Any], async_batching: bool
) -> None:
    """One request 4x the window long (a 3-window prompt in block-sized chunks, then 4 windows of decoding):
    the blocks it holds (block manager's allocated count, held ones included) stay within
    ceil(W / block_size) + 2, and its tokens equal transformers'."""
    folder, model = mistral
    prompt = _prompts((3 * WINDOW,))[0]
    llm = LLM(
        model=folder,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=256,
        kv_cache_memory=2**22,
        max_num_batched_tokens=BLOCK_SIZE,
        async_batching=async_batching,
    )
    engine = llm.engine
    engine.add_request(prompt, GREEDY)
    peak, tokens = 0, []
    while engine.has_work():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        peak = max(peak, engine.blocks.num_allocated)
    engine.check_idle()
    bound = -(-WINDOW // BLOCK_SIZE) + 2
    total = -(-(len(prompt) + GREEDY.max_tokens) // BLOCK_SIZE)
    assert peak <= bound, f"the request held {peak} blocks at once; bound {bound} (all its tokens need {total})"
    compare(hf_greedy(model, [prompt], GREEDY.max_tokens), [tokens], allow_ties=True, tie_gap=1e-3)


def test_window_matters_here(mistral: tuple[str, Any], tmp_path: Any) -> None:
    """Control: the same weights without the window generate other tokens on these prompts (so the parity tests
    above and below could fail if the window were ignored)."""
    _folder, model = mistral
    prompts = _prompts((3 * WINDOW + 5,))
    full = build_tiny_model("mistral", str(tmp_path / "full"), sliding_window=None)
    assert hf_greedy(full, prompts, 24)[0].token_ids != hf_greedy(model, prompts, 24)[0].token_ids


@pytest.mark.parametrize("case", ["one-step-prefill", "chunked", "prefix-cache-hit"])
def test_windowed_models_match_transformers(mistral: tuple[str, Any], case: str) -> None:
    folder, model = mistral
    prompts = _prompts((5, 3 * WINDOW + 3, 4 * WINDOW))
    options: dict[str, Any] = dict(dtype="float32", block_size=BLOCK_SIZE, max_model_len=256, kv_cache_memory=2**22)
    if case == "chunked":
        options["max_num_batched_tokens"] = 8
    llm = LLM(model=folder, **options)
    if case == "prefix-cache-hit":  # the long prompt's blocks are cached (some freed mid-request), then reused
        shared = prompts[2][: 3 * WINDOW]
        prompts = [shared + p[:9] for p in prompts]
        llm.generate([[*shared, 5]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    if case == "prefix-cache-hit":
        assert llm.engine.stats().prefix_hit_tokens > 0, "the shared prompt was meant to hit the prefix cache"
    compare(hf_greedy(model, prompts, 24), [o.outputs[0].token_ids for o in outs], allow_ties=True, tie_gap=1e-3)
    llm.engine.check_idle()


def test_mixed_local_and_global_layers_match_transformers(tmp_path: Any) -> None:
    """Qwen2 with use_sliding_window: layers from max_window_layers on are windowed, the others attend fully
    (no block is freed then: the full layers need every position)."""
    model = build_tiny_model(
        "qwen2", str(tmp_path), use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    prompts = _prompts((7, 3 * WINDOW + 1))
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=256,
        kv_cache_memory=2**22,
        max_num_batched_tokens=16,
    )
    assert llm.engine.spec.kv_window is None
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    compare(hf_greedy(model, prompts, 24), [o.outputs[0].token_ids for o in outs], allow_ties=True, tie_gap=1e-3)


@pytest.mark.parametrize("async_batching", [False, True])
def test_preemption_with_sliding_windows_matches_transformers(mistral: tuple[str, Any], async_batching: bool) -> None:
    """Eight requests, each 2-5 windows long, in a pool of 20 blocks (the least one max_model_len request may need;
    each request holds up to ceil(W / block) + 2 = 6 at once while decoding): running requests are preempted and
    recomputed (their freed, windowed-out blocks included), and every request's tokens still equal
    transformers'; no block leaks."""
    folder, model = mistral
    new_tokens = 2 * WINDOW
    prompts = _prompts(
        (WINDOW + 3, 2 * WINDOW, 2 * WINDOW + 7, 3 * WINDOW, 9, 3 * WINDOW - 1, 5, 2 * WINDOW + 1), seed=11
    )
    block_bytes = 2 * model.config.num_hidden_layers * 2 * 16 * 4 * BLOCK_SIZE  # K and V, 2 kv heads of 16, float32
    llm = LLM(
        model=folder,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=3 * WINDOW + new_tokens,
        kv_cache_memory=20 * block_bytes,
        max_num_batched_tokens=16,
        async_batching=async_batching,
    )
    assert llm.engine.stats().kv_blocks_total == 20
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert llm.engine.stats().num_preemptions > 0, "the small pool was meant to force preemption"
    llm.engine.check_idle()
    compare(
        hf_greedy(model, prompts, new_tokens), [o.outputs[0].token_ids for o in outs], allow_ties=True, tie_gap=1e-3
    )
