"""Incremental detokenization ends exactly at the full decode and never emits broken characters."""

from __future__ import annotations

import random
from typing import Any

import pytest

from conveyor.engine.detokenizer import IncrementalDetokenizer, window_decoder

TEXTS = [
    "Hello, world! How are you today?",
    "Ünïcödé — naïve café, 東京タワー and emoji 🚀🔥 mixed in.",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "def f(x):\n    return x ** 2  # squares\n",
    "日本語のテキストを分割します。",
]


@pytest.fixture(scope="module")
def tokenizer(default_llm: Any) -> Any:
    return default_llm.get_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer: Any, text: str) -> None:
    prompt = tokenizer("Prompt:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    assert not any("\ufffd" in p for p in pieces)
    streamed = "".join(pieces) + detok.finish()
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True) == detok.text


def test_random_token_streams(tokenizer: Any) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
        streamed = "".join(detok.add(t) for t in ids)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        tail = detok.finish()
        assert detok.text == full
        if full.startswith(streamed):
            assert streamed + tail == full


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_window_decoder_equals_the_tokenizers_decode(tokenizer: Any, skip_special_tokens: bool) -> None:
    """The detokenizer's direct backend decode gives exactly what transformers' decode gives, on random
    windows that include special tokens, for the default model's tokenizer (which takes the direct path)."""
    decode = window_decoder(tokenizer, skip_special_tokens)
    assert decode.__closure__ is not None and any(  # the direct path, not the transformers wrapper
        cell.cell_contents is tokenizer.backend_tokenizer for cell in decode.__closure__
    )
    rng = random.Random(1)
    special = list(tokenizer.all_special_ids)
    for _ in range(200):
        ids = [
            rng.choice(special) if rng.random() < 0.1 else rng.randrange(tokenizer.vocab_size)
            for _ in range(rng.randrange(0, 12))
        ]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
