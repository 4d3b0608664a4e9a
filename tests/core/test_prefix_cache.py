"""Prefix caching: a request sharing a 3-block prefix with an earlier one reuses those blocks."""

from __future__ import annotations

from typing import Any

from conveyor import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_shared_prefix_hits_and_matches_cold_run(default_llm: Any) -> None:
    engine = default_llm.engine
    block = engine.blocks.block_size
    tok = default_llm.get_tokenizer()
    prefix = tok(
        "You are a careful assistant. Answer every question about European geography with one precise "
        "sentence, naming the country and the region, and never add anything else at all. " * 3
    ).input_ids
    prefix = prefix[: 3 * block]
    assert len(prefix) == 3 * block
    first = prefix + tok(" Question: Where is Lyon?").input_ids
    second = prefix + tok(" Question: Where is Porto? Answer:").input_ids

    engine.blocks.reset_prefix_cache()
    cold = default_llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0

    engine.blocks.reset_prefix_cache()
    default_llm.generate([first], GREEDY, use_tqdm=False)
    hits_before = engine.blocks.prefix_hit_tokens
    warm = default_llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert engine.blocks.prefix_hit_tokens - hits_before == 3 * block
    assert warm.num_cached_tokens == 3 * block
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    engine.check_idle()


def test_identical_prompt_leaves_one_token_to_compute(default_llm: Any) -> None:
    engine = default_llm.engine
    prompt = list(range(1000, 1000 + 2 * engine.blocks.block_size))  # exactly two full blocks
    engine.blocks.reset_prefix_cache()
    a = default_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    b = default_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == engine.blocks.block_size  # the last block is recomputed to get logits
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    engine.check_idle()
