"""The offline API: input forms, output order, chat, seeds, and clear errors for bad input."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor import InvalidRequestError, SamplingParams


def test_input_forms_and_order(default_llm: Any) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    tok = default_llm.get_tokenizer()
    texts = ["The quick brown fox", "1, 2, 3,", "Paris is the capital of"]
    by_text = default_llm.generate(texts, greedy, use_tqdm=False)
    by_ids = default_llm.generate([tok(t).input_ids for t in texts], greedy, use_tqdm=False)
    single = default_llm.generate(texts[1], greedy, use_tqdm=False)
    assert [o.prompt for o in by_text] == texts
    assert [o.prompt_token_ids for o in by_text] == [tok(t).input_ids for t in texts]
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert single[0].outputs[0].token_ids == by_text[1].outputs[0].token_ids
    for o in by_text:
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("stop", "length")
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_per_prompt_params_and_stop_reasons(default_llm: Any) -> None:
    tok = default_llm.get_tokenizer()
    prompt = tok("1, 2, 3, 4,").input_ids
    probe = default_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    third = probe.outputs[0].token_ids[2]
    outs = default_llm.generate(
        [prompt, prompt],
        [
            SamplingParams(max_tokens=3, temperature=0.0),
            SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[third]),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 3
    stopped = outs[1].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == third
    assert stopped.token_ids == probe.outputs[0].token_ids[:3]
    if third not in probe.outputs[0].token_ids[:2]:  # the stop token's text is left out, unless asked for
        assert stopped.text == tok.decode(probe.outputs[0].token_ids[:2])
        kept = default_llm.generate(
            [prompt],
            SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[third], include_stop_str_in_output=True),
            use_tqdm=False,
        )[0]
        assert kept.outputs[0].text == tok.decode(probe.outputs[0].token_ids[:3])


def test_vllm_prompt_dicts_and_chat_content_parts(default_llm: Any) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    tok = default_llm.get_tokenizer()
    text = "The quick brown fox"
    plain = default_llm.generate(text, greedy, use_tqdm=False)[0].outputs[0].token_ids
    as_dicts = default_llm.generate(
        [{"prompt": text}, {"prompt_token_ids": tok(text).input_ids}], greedy, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in as_dicts] == [plain, plain]
    assert default_llm.generate({"prompt": text}, greedy, use_tqdm=False)[0].prompt == text
    with pytest.raises(InvalidRequestError, match="'prompt' .* or 'prompt_token_ids'"):
        default_llm.generate({"text": text}, greedy, use_tqdm=False)
    question = [{"role": "user", "content": "Name a color.\nOne word."}]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}, {"type": "text", "text": "One word."}]}
    ]  # joined with "\n", as vLLM
    assert default_llm.apply_chat_template(parts) == default_llm.apply_chat_template(question)
    assert (
        default_llm.chat(parts, greedy, use_tqdm=False)[0].outputs[0].token_ids
        == default_llm.chat(question, greedy, use_tqdm=False)[0].outputs[0].token_ids
    )
    empty_system = [{"role": "system", "content": None}, *question]
    assert default_llm.apply_chat_template(empty_system) == default_llm.apply_chat_template(
        [{"role": "system", "content": ""}, *question]
    )
    for bad, fragment in (
        ([{"role": "user", "content": 7}], "got a int"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "parts other than text"),
        ("hello", "got a str"),
        ([{"role": "user"}], "must be a dict with 'role' and 'content'"),
    ):
        with pytest.raises(InvalidRequestError, match=fragment):
            default_llm.chat(bad, greedy, use_tqdm=False)


def test_without_sampling_params_the_models_recommended_settings_apply(default_llm: Any) -> None:
    from conveyor.model.loader import DEFAULT_MODEL_SAMPLING

    out = default_llm.generate("Once upon a time", use_tqdm=False)[0]  # 16 tokens, as SamplingParams' default
    seeded = default_llm.generate("Once upon a time", SamplingParams(**DEFAULT_MODEL_SAMPLING), use_tqdm=False)[0]
    assert default_llm.engine.sampling_defaults == DEFAULT_MODEL_SAMPLING
    assert len(out.outputs[0].token_ids) == len(seeded.outputs[0].token_ids)


def test_eos_ends_with_stop_and_ignore_eos_continues(default_llm: Any) -> None:
    msgs = [{"role": "user", "content": "Say hi."}]
    out = default_llm.chat(msgs, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in default_llm.engine.spec.eos_token_ids
    longer = default_llm.chat(
        msgs, SamplingParams(max_tokens=len(out.token_ids) + 5, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert longer.finish_reason == "length" and longer.token_ids[: len(out.token_ids)] == out.token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(default_llm: Any) -> None:
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=123)
    alone = default_llm.generate(["Tell me a story"], p, use_tqdm=False)[0].outputs[0].token_ids
    crowd = default_llm.generate(
        ["Hello", "Tell me a story", "Why?"],
        [SamplingParams(max_tokens=5, temperature=1.0), p, SamplingParams(max_tokens=20, temperature=0.0)],
        use_tqdm=False,
    )
    assert crowd[1].outputs[0].token_ids == alone
    other = default_llm.generate(["Tell me a story"], p.clone(seed=124), use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_chat_many_conversations(default_llm: Any) -> None:
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "What color is the sky?"},
        ],
    ]
    outs = default_llm.chat(convs, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert len(outs) == 2 and "Paris" in outs[0].outputs[0].text
    assert "<|im_start|>system\nYou answer in one word." in outs[1].prompt


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([], "no prompts"),
        ([[1, 2, 10**9]], "not an integer in [0, 49152)"),
        ([[]], "empty"),
        ([3.5], "must be a string, a list of token ids or a dict"),
        ([list(range(1, 1100))], "max_model_len is 1024"),
    ],
)
def test_bad_prompts_are_refused_clearly(default_llm: Any, prompts: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=None) as info:
        default_llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert message in str(info.value)
    default_llm.engine.check_idle()


def test_mismatched_params_list_admits_nothing(default_llm: Any) -> None:
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 3 prompts"):
        default_llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="index 1"):
        default_llm.generate(["fine", [1, -5]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not default_llm.engine.has_work()
    default_llm.engine.check_idle()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(seed=2**63), "seed=9223372036854775808"),  # int64: negative seeds are valid (OpenAI, vLLM)
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(max_token=5), "no field 'max_token'"),
        (dict(n=True), "n=True is invalid: must be a whole number, got a bool"),
        (dict(seed="7"), "seed='7' is invalid: must be a whole number, got a str"),
        (dict(max_tokens=3.0), "max_tokens=3.0 is invalid: must be a whole number"),
        (dict(temperature=float("nan")), "temperature=nan is invalid: must be a number, got NaN"),
        (dict(temperature="0.5"), "must be a number, got a str"),
        (dict(ignore_eos="yes"), "ignore_eos='yes'"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert fragment in str(info.value)


def test_sampling_params_take_numpy_numbers_and_ints_for_floats() -> None:
    import numpy as np

    p = SamplingParams(n=np.int64(2), max_tokens=np.int32(5), temperature=1, top_p=np.float32(0.5), seed=np.uint8(3))
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.seed) == (2, 5, 1.0, 0.5, 3)
    assert type(p.n) is int and type(p.temperature) is float


def test_final_only_requests_give_one_output_the_same_as_streamed(default_llm: Any) -> None:
    """Engine.add_request(final_only=True) (LLM.generate's way): step() gives the request's output once, when it
    ends, and that output (n samples, text, stop string, logprobs) is the one a streamed request ends with."""
    engine = default_llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=2, logprobs=1, stop=[" the"])
    streamed_id = engine.add_request("Once upon a time", params)
    final_id = engine.add_request("Once upon a time", params, final_only=True)
    seen: dict[str, list[Any]] = {streamed_id: [], final_id: []}
    while engine.has_work():
        for out in engine.step():
            seen[out.request_id].append(out)
    streamed, final = seen[streamed_id], seen[final_id]
    assert len(streamed) > 1 and not any(o.finished for o in streamed[:-1]) and streamed[-1].finished
    assert len(final) == 1 and final[0].finished
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in final[0].outputs] == [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in streamed[-1].outputs
    ]
    assert final[0].metrics.keys() == streamed[-1].metrics.keys()
    engine.check_idle()
