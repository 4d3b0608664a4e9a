"""The embedded SmolLM2-135M-Instruct: our engine vs transformers' own GGUF loading, float32 greedy."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor import LLM, SamplingParams
from helpers.parity import check_teacher_forced

NEW_TOKENS = 64
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is 17 times 23?",
]
RAW = [
    "1, 2, 3, 4,",
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "Paris is",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\nimport torch\n\n# A function that computes the softmax of a tensor along an axis\n"
    "def softmax(x, axis=-1):\n",
    "The history of the Roman Empire spans more than a thousand years. It began when Augustus became the first "
    "emperor in 27 BC, and the Western half fell in 476 AD. The Eastern half, known as the Byzantine Empire, "
    "survived until the fall of Constantinople in 1453. Historians still debate the causes of the decline: "
    "economic trouble, military defeats, political instability and migration all played a part. During those "
    "centuries, the empire",
]


@pytest.fixture(scope="module")
def prompts(default_llm: Any) -> list[list[int]]:
    tok = default_llm.get_tokenizer()
    chat = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return [tok(p).input_ids for p in chat + RAW]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_prompts_are_varied(prompts: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 16 and lengths[0] < 16 and lengths[-1] > 3 * 16, lengths  # within one block .. 3+ blocks


def test_default_model_batch_matches_transformers(
    default_llm: Any, hf_default_model: Any, prompts: list[list[int]]
) -> None:
    outs = default_llm.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    check_teacher_forced(hf_default_model, prompts, got, NEW_TOKENS, allow_ties=False)
    default_llm.engine.check_idle()


@pytest.mark.parametrize("case", ["preemption", "chunked"])
def test_default_model_under_pressure_matches_transformers(
    hf_default_model: Any, prompts: list[list[int]], case: str
) -> None:
    n, new = 8, 32
    if case == "preemption":  # 13 blocks of 16 tokens: room for one 200-token request, not for eight
        llm = LLM(dtype="float32", max_model_len=200, kv_cache_memory=13 * 16 * 46080, max_num_seqs=8)
    else:
        llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory="64MiB", max_num_batched_tokens=24)
    chosen = prompts[::2][:n]
    outs = llm.generate(chosen, GREEDY.clone(max_tokens=new), use_tqdm=False)
    check_teacher_forced(hf_default_model, chosen, [o.outputs[0].token_ids for o in outs], new, allow_ties=False)
    stats = llm.engine.stats()
    if case == "preemption":
        assert stats.num_preemptions > 0
    else:
        assert stats.num_partial_prefills > 0
    llm.engine.check_idle()


def test_chat_answers_capital_of_france(default_llm: Any) -> None:
    out = default_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0.0),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
