"""NaN and infinity never pass silently: a request whose logits are not finite ends with finish_reason "error" and
a message (LLM.generate raises NonFiniteLogitsError), counted in the stats, while its batch mates finish normally;
sync and async batching, multi-step plans, n > 1, logprobs and sampled rows alike."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from conveyor import LLM, ConveyorError, NonFiniteLogitsError, SamplingParams
from conveyor.outputs import NON_FINITE_LOGITS
from helpers.tiny_models import build_tiny_model

POISON = 7
"""A token whose embedding row is NaN in the poisoned engines: any request that reads it computes NaN from there."""
ENGINE = dict(block_size=4, max_model_len=128, kv_cache_memory=2**20)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: Any) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-llama-nan"))
    build_tiny_model("llama", folder)
    return folder


def _poisoned(folder: str, token: int = POISON, **options: Any) -> LLM:
    """An engine whose model computes NaN for any sequence holding `token` (its embedding row set to NaN after the
    model loaded, so that no load-time check can refuse it): a real forward, with NaN in some rows only."""
    llm = LLM(model=folder, **(ENGINE | options))
    with torch.no_grad():
        llm.engine.runner.model.embed[token] = float("nan")
    return llm


def _kinds(i: int) -> SamplingParams:
    return [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, seed=i, top_k=20, ignore_eos=True, logprobs=2),
        SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=i, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
    ][i % 4]


@pytest.mark.parametrize("async_batching", [False, True])
def test_only_the_requests_with_nan_logits_fail(tiny_llama: str, async_batching: bool) -> None:
    llm = _poisoned(tiny_llama, async_batching=async_batching)
    prompts = [[11 + i, 40 + i, POISON if i % 2 else 90 + i, 60] for i in range(8)]  # odd ones read the NaN row
    with pytest.raises(NonFiniteLogitsError, match=r"4 of 8 prompt\(s\) failed .*not finite") as caught:
        llm.generate(prompts, [_kinds(i // 2) for i in range(8)], use_tqdm=False)
    outputs = caught.value.outputs
    for i, out in enumerate(outputs):
        if i % 2:
            assert out.error_code == NON_FINITE_LOGITS and "not finite (NaN or infinity)" in (out.error or "")
            assert all(c.finish_reason == "error" and c.token_ids == [] for c in out.outputs), out
        else:
            assert out.error is None and out.error_code is None
            assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in out.outputs), out
            assert all(POISON not in c.token_ids for c in out.outputs)  # else a NaN would have followed
    assert llm.engine.stats().num_non_finite == 4
    llm.engine.check_idle()
    llm.engine.close()


@pytest.mark.parametrize("async_batching", [False, True])
@pytest.mark.parametrize("num_scheduler_steps", [1, 8])
def test_nan_mid_generation_keeps_the_output_so_far(
    tiny_llama: str, async_batching: bool, num_scheduler_steps: int
) -> None:
    """The NaN comes from a generated token (its embedding poisoned): the request ends at the next token, its
    output up to there kept; inside a multi-step plan (num_scheduler_steps 8) the tokens planned past it are
    dropped."""
    prompt = [3, 14, 15, 92, 65]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    clean = LLM(model=tiny_llama, **ENGINE)
    tokens = clean.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    clean.engine.close()
    k = next(k for k in range(2, 10) if tokens[k] not in prompt + tokens[:k])  # its first time in the sequence
    llm = _poisoned(tiny_llama, tokens[k], async_batching=async_batching, num_scheduler_steps=num_scheduler_steps)
    with pytest.raises(NonFiniteLogitsError) as caught:
        llm.generate([prompt], greedy, use_tqdm=False)
    out = caught.value.outputs[0]
    assert out.outputs[0].token_ids == tokens[: k + 1] and out.outputs[0].finish_reason == "error"
    assert f"at output token {k + 1} " in (out.error or "")
    streamed = llm.engine.add_request(prompt, greedy)  # final_only=False: outputs at every step, no multi-step
    last = None
    while llm.engine.has_work():
        last = next((o for o in llm.engine.step() if o.request_id == streamed), last)
    assert last is not None and last.finished and last.error_code == NON_FINITE_LOGITS
    assert last.outputs[0].token_ids == tokens[: k + 1]
    llm.engine.check_idle()
    llm.engine.close()


@pytest.mark.parametrize("broken", ["epsilon", "weight"])
def test_a_nan_epsilon_or_weight_is_an_error_not_token_0(tmp_path: Any, broken: str) -> None:
    """A model file with a NaN norm epsilon or a NaN weight: an error that says why (at load, where a check
    refuses the file, or when its logits come out NaN), never tokens drawn from NaN (token 0, the first NaN)."""
    folder = str(tmp_path / broken)
    model = build_tiny_model("llama", folder)
    if broken == "epsilon":  # as json writes a NaN (transformers would write {"__float__": "NaN"})
        config_path = os.path.join(folder, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        with open(config_path, "w") as f:
            json.dump(config | {"rms_norm_eps": float("nan")}, f)
    else:
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight[3, 5] = float("nan")
        model.save_pretrained(folder)
    with pytest.raises(ConveyorError, match=r"(?i)nan|not finite") as caught:
        llm = LLM(model=folder, **ENGINE)
        try:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        finally:
            llm.engine.close()
    if isinstance(caught.value, NonFiniteLogitsError):
        assert caught.value.outputs[0].outputs[0].token_ids == []
