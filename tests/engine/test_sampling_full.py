"""Complete sampling: processors against references, batch/seed invariance, logprobs, n > 1."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from conveyor import LLM, InvalidRequestError, SamplingParams
from conveyor.engine.engine import sample_seed
from conveyor.model.sampler import PenaltyTensors, SamplingTensors, apply_min_p, apply_penalties, process_logits
from helpers.tiny_models import build_tiny_model

VOCAB = 64


def _penalty_tensors(
    histories: list[tuple[list[int], list[int]]], presence: list[float], frequency: list[float], repetition: list[float]
) -> PenaltyTensors:
    rows, tokens, is_output = [], [], []
    for i, (prompt, output) in enumerate(histories):
        for j, t in enumerate(prompt + output):
            rows.append(i)
            tokens.append(t)
            is_output.append(j >= len(prompt))
    return PenaltyTensors(
        torch.tensor(rows),
        torch.tensor(tokens),
        torch.tensor(is_output),
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )


def _histories(rng: random.Random, rows: int) -> list[tuple[list[int], list[int]]]:
    return [
        (
            [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))],
            [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))],
        )
        for _ in range(rows)
    ]


@pytest.mark.parametrize("seed", range(3))
def test_repetition_penalty_matches_transformers(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    logits = torch.randn(5, VOCAB) * 3
    histories = _histories(rng, 5)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.05]
    ours = apply_penalties(logits, _penalty_tensors(histories, [0.0] * 5, [0.0] * 5, penalties))
    for i, ((prompt, output), penalty) in enumerate(zip(histories, penalties)):
        ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], ref)


@pytest.mark.parametrize("seed", range(3))
def test_presence_and_frequency_follow_openai_formula(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    logits = torch.randn(4, VOCAB)
    histories = _histories(rng, 4)
    presence, frequency = [0.0, 0.5, -1.0, 2.0], [0.3, 0.0, 1.5, -0.7]
    ours = apply_penalties(logits, _penalty_tensors(histories, presence, frequency, [1.0] * 4))
    for i, (_prompt, output) in enumerate(histories):
        expected = logits[i].clone()
        for token in set(output):  # OpenAI: generated tokens only
            count = output.count(token)
            expected[token] -= count * frequency[i] + presence[i]
        torch.testing.assert_close(ours[i], expected)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_matches_transformers(min_p: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB) * 2
    ours = apply_min_p(logits, torch.full((6,), min_p))
    if min_p > 0:
        ref = MinPLogitsWarper(min_p)(torch.zeros(6, 1, dtype=torch.long), logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
        torch.testing.assert_close(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])
    else:
        assert torch.equal(ours, logits)


def test_temperature_scaling_matches_transformers() -> None:
    """Temperature divides the processed logits; sampling at T equals argmax(logits / T + Gumbel)."""
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB)
    for temperature in (0.3, 1.0, 1.7):
        ref = TemperatureLogitsWarper(temperature)(torch.zeros(3, 1, dtype=torch.long), logits.clone())
        torch.testing.assert_close(logits / torch.full((3, 1), temperature), ref)


def test_logit_bias_and_suppression_by_hand() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    t = SamplingTensors(
        temperature=torch.ones(3),
        top_k=torch.zeros(3, dtype=torch.long),
        top_p=torch.ones(3),
        seeds=torch.zeros(3, dtype=torch.long),
        output_index=torch.zeros(3, dtype=torch.long),
        all_greedy=False,
        any_top_k_or_p=False,
        bias=(torch.tensor([0, 0, 2]), torch.tensor([5, 9, 5]), torch.tensor([3.5, -100.0, 0.25])),
        suppress=(torch.tensor([1, 1]), torch.tensor([2, 7])),
    )
    got = process_logits(logits.clone(), t)
    expected = logits.clone()
    expected[0, 5] += 3.5
    expected[0, 9] -= 100.0
    expected[2, 5] += 0.25
    expected[1, 2] = float("-inf")
    expected[1, 7] = float("-inf")
    torch.testing.assert_close(got, expected)


# ---- the engine, on a tiny random Llama ------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: Any) -> tuple[str, Any]:
    folder = str(tmp_path_factory.mktemp("tiny-llama-sampling"))
    return folder, build_tiny_model("llama", folder)


def _engine_options(pressure: str) -> dict[str, Any]:
    base: dict[str, Any] = dict(block_size=4, max_model_len=128, kv_cache_memory=2**20)
    if pressure == "preemption":
        base.update(max_model_len=96, kv_cache_memory=26 * 4 * 512)
    if pressure == "chunked":
        base.update(max_num_batched_tokens=10)
    return base


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 50))] for _ in range(n)]


@pytest.mark.parametrize("pressure", ["none", "preemption", "chunked"])
@pytest.mark.parametrize("async_batching", [False, True])
def test_greedy_repetition_penalty_matches_transformers_generate(
    tiny: tuple[str, Any], pressure: str, async_batching: bool
) -> None:
    folder, hf_model = tiny
    prompts = _prompts(8, seed=11)
    llm = LLM(model=folder, async_batching=async_batching, **_engine_options(pressure))
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.8, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=20,
                do_sample=False,
                repetition_penalty=1.8,
                eos_token_id=-1,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
    stats = llm.engine.stats()
    if pressure == "preemption":
        assert stats.num_preemptions > 0
    if pressure == "chunked":
        assert stats.num_partial_prefills > 0
    llm.engine.check_idle()


MIXED = [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=14, temperature=0.8, seed=1, presence_penalty=0.8, frequency_penalty=0.4),
    SamplingParams(max_tokens=10, temperature=1.2, seed=2, top_k=30, min_p=0.05, repetition_penalty=1.2),
    SamplingParams(max_tokens=16, temperature=0.0, logit_bias={7: 5.0, 8: -100.0}, logprobs=3),
    SamplingParams(max_tokens=12, temperature=0.9, seed=3, top_p=0.9, min_tokens=6, logprobs=2),
    SamplingParams(n=3, max_tokens=9, temperature=1.0, seed=4),
    SamplingParams(max_tokens=11, temperature=0.7, seed=5, prompt_logprobs=2),
]


def _assert_same(a: Any, b: Any) -> None:
    """Same tokens and finish reasons; logprobs equal up to float noise of a different batch shape."""
    assert [(c.token_ids, c.finish_reason) for c in a.outputs] == [(c.token_ids, c.finish_reason) for c in b.outputs]
    for ca, cb in zip(a.outputs, b.outputs):
        assert (ca.logprobs is None) == (cb.logprobs is None)
        for x, y in zip(ca.logprobs or [], cb.logprobs or []):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
    for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4


@pytest.mark.parametrize("async_batching", [False, True])
def test_mixed_batch_equals_each_request_alone(tiny: tuple[str, Any], async_batching: bool) -> None:
    folder, _ = tiny
    prompts = _prompts(len(MIXED), seed=5)
    batch_llm = LLM(model=folder, async_batching=async_batching, **_engine_options("chunked"))
    together = batch_llm.generate(prompts, MIXED, use_tqdm=False)
    alone_llm = LLM(model=folder, async_batching=False, **_engine_options("none"))
    for prompt, params, out in zip(prompts, MIXED, together):
        alone = alone_llm.generate([prompt], params, use_tqdm=False)[0]
        _assert_same(out, alone)
    batch_llm.engine.check_idle()


def test_n_samples_share_prompt_blocks_and_equal_their_seeded_singles(tiny: tuple[str, Any]) -> None:
    folder, _ = tiny
    prompt = _prompts(1, seed=9)[0] + list(range(100, 130))  # several blocks and a partial one
    llm = LLM(model=folder, **_engine_options("none"))
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=77, ignore_eos=True), "g")
    samples = [engine.scheduler.get(f"g#{i}") for i in range(4)]
    shared_checked = False
    final = None
    while engine.has_work():
        for out in engine.step():
            final = out
        tables = [engine.blocks.block_table(f"g#{i}") for i in range(4)]
        if not shared_checked and all(tables):
            full = len(prompt) // engine.blocks.block_size
            assert all(t[:full] == tables[0][:full] for t in tables), "prompt blocks are not shared"
            assert engine.stats().prefix_query_tokens == len(prompt), "the prompt was admitted more than once"
            shared_checked = True
    assert shared_checked and final is not None and final.finished and len(final.outputs) == 4
    assert all(s is not None for s in samples)
    singles = [
        llm.generate(
            [prompt],
            SamplingParams(max_tokens=10, temperature=1.0, seed=sample_seed(77, i), ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
        for i in range(4)
    ]
    assert [c.token_ids for c in final.outputs] == singles
    assert len({tuple(s) for s in singles}) > 1
    engine.check_idle()


def test_min_tokens_holds_back_eos(tiny: tuple[str, Any]) -> None:
    folder, _ = tiny
    llm = LLM(model=folder, **_engine_options("none"))
    prompt = _prompts(1, seed=3)[0]
    probe = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0]
    stop_token = probe.token_ids[1]
    early = llm.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_token]), use_tqdm=False
    )[0].outputs[0]
    held = llm.generate(
        [prompt],
        SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_token], min_tokens=5),
        use_tqdm=False,
    )[0].outputs[0]
    assert early.token_ids == probe.token_ids[:2] and early.finish_reason == "stop"
    assert len(held.token_ids) >= 5 and stop_token not in held.token_ids[:5]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(n=0), "n=0"),
        (dict(min_p=1.5), "min_p=1.5"),
        (dict(presence_penalty=3), "presence_penalty=3"),
        (dict(frequency_penalty=-2.5), "frequency_penalty=-2.5"),
        (dict(repetition_penalty=0), "repetition_penalty=0"),
        (dict(logprobs=21), "logprobs=21"),
        (dict(prompt_logprobs=-1), "prompt_logprobs=-1"),
        (dict(stop=[""]), "non-empty"),
        (dict(stop=["x"] * 65), "stop"),
        (dict(logit_bias={5: 200.0}), "outside [-100, 100]"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens=10"),
    ],
)
def test_new_fields_are_validated(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert fragment in str(info.value)


def test_out_of_vocab_bias_is_refused(tiny: tuple[str, Any]) -> None:
    folder, _ = tiny
    llm = LLM(model=folder, **_engine_options("none"))
    with pytest.raises(InvalidRequestError, match="outside the model's vocabulary"):
        llm.generate([[5, 6]], SamplingParams(logit_bias={10_000: 1.0}), use_tqdm=False)


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny: tuple[str, Any]) -> None:
    folder, _ = tiny
    prompts = _prompts(6, seed=21)
    params = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    calm = LLM(model=folder, **_engine_options("none")).generate(prompts, params, use_tqdm=False)
    options = _engine_options("preemption") | {"max_num_batched_tokens": 8}
    pressed_llm = LLM(model=folder, **options)
    pressed = pressed_llm.generate(prompts, params, use_tqdm=False)
    assert pressed_llm.engine.stats().num_preemptions > 0
    for prompt, a, b in zip(prompts, calm, pressed):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(b.prompt_logprobs) == len(prompt) == len(a.prompt_logprobs)
        for i, (x, y) in enumerate(zip(a.prompt_logprobs, b.prompt_logprobs)):
            assert (x is None) == (y is None) == (i == 0)
            if x is not None and y is not None:
                assert x.token_id == y.token_id == prompt[i] and abs(x.logprob - y.logprob) < 1e-4


def test_reused_request_id_never_gets_an_old_token(tiny: tuple[str, Any]) -> None:
    folder, _ = tiny
    first, second = _prompts(2, seed=31)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reference = LLM(model=folder, **_engine_options("none")).generate([second], greedy, use_tqdm=False)[0]
    engine = LLM(model=folder, async_batching=True, **_engine_options("none")).engine
    engine.add_request(first, greedy.clone(max_tokens=50), "r")
    engine.step()
    engine.step()
    engine.abort("r")
    engine.add_request(second, greedy, "r")
    final = None
    while engine.has_work():
        for out in engine.step():
            final = out
    assert final is not None and final.outputs[0].token_ids == reference.outputs[0].token_ids
    engine.check_idle()


def test_colliding_sample_id_is_refused_cleanly(tiny: tuple[str, Any]) -> None:
    folder, _ = tiny
    engine = LLM(model=folder, **_engine_options("none")).engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3), "y#1")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([5, 6, 7], SamplingParams(n=2, max_tokens=3), "y")
    while engine.has_work():
        engine.step()
    engine.check_idle()


def test_n_above_max_num_seqs_is_rejected_with_both_numbers(tiny: tuple[str, Any]) -> None:
    folder, _ = tiny
    llm = LLM(model=folder, max_num_seqs=3, **_engine_options("none"))
    with pytest.raises(InvalidRequestError, match=r"n=4 samples .* max_num_seqs is 3"):
        llm.generate([[5, 6, 7]], SamplingParams(n=4, max_tokens=2))
    out = llm.generate([[5, 6, 7]], SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    llm.engine.check_idle()
