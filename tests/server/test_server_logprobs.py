"""Token text and bytes of the server's logprobs: the bytes rebuild the text, also inside characters."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from conveyor.server.logprobs import TextOffsets, TokenBytes, chat_logprobs, completion_logprobs, echoed

TEXT = "Repeat: 😀 😃 日本語, café — naïve <|im_end|> done"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from conveyor.model.gguf_loader import load_gguf_tokenizer
    from conveyor.model.loader import default_model_path

    return load_gguf_tokenizer(default_model_path())


def test_byte_level_tokens_rebuild_the_text(tokenizer: Any) -> None:
    tokens = TokenBytes(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    parts = [tokens.of(i) for i in ids]
    assert b"".join(raw for raw, _ in parts).decode("utf-8") == TEXT
    partial = [(raw, text) for raw, text in parts if text.startswith("bytes:")]
    assert partial, "the emoji and CJK characters should be split across tokens"
    for raw, text in partial:  # not valid UTF-8 alone: shown as escapes, which name the bytes exactly
        with pytest.raises(UnicodeDecodeError):
            raw.decode("utf-8")
        assert text == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    for raw, text in parts:
        if not text.startswith("bytes:"):
            assert raw.decode("utf-8") == text == tokenizer.decode([ids[parts.index((raw, text))]])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokens.of(end) == (b"<|im_end|>", "<|im_end|>")


def test_completion_offsets_count_characters_where_they_complete(tokenizer: Any) -> None:
    tokens = TokenBytes(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    entries = [(i, -1.0, [(i, -1.0)]) for i in ids]
    counter = TextOffsets()
    counter.chars = 7  # seven characters of this choice went out before
    lp = completion_logprobs(tokens, entries, counter)
    offsets = lp["text_offset"]
    halves = TextOffsets()
    halves.chars = 7
    cut = 3  # after " \\xf0\\x9f\\x98", inside the first emoji: a streamed chunk can end there
    split = (
        completion_logprobs(tokens, entries[:cut], halves)["text_offset"]
        + completion_logprobs(tokens, entries[cut:], halves)["text_offset"]
    )
    assert split == offsets
    assert offsets[0] == 7 and offsets == sorted(offsets)
    ascii_prefix = tokenizer("Repeat:", add_special_tokens=False)["input_ids"]
    expected = [7 + len(tokenizer.decode(ascii_prefix[:k])) for k in range(len(ascii_prefix))]
    assert offsets[: len(ascii_prefix)] == expected
    last_raw = tokens.of(ids[-1])[0]
    assert offsets[-1] == 7 + len(TEXT) - len(last_raw.decode("utf-8"))
    assert lp["top_logprobs"][0] == {tokens.of(ids[0])[1]: -1.0}
    chat = chat_logprobs(tokens, entries)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode("utf-8") == TEXT
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in chat)


def test_echoed_prompt_positions() -> None:
    from conveyor.core.plan import TokenLogprobs

    lps = [None, TokenLogprobs(5, -0.5, 2, [(4, -0.1)]), TokenLogprobs(6, -1.5, 1, [])]
    assert echoed([4, 5, 6], lps) == [(4, None, None), (5, -0.5, [(4, -0.1)]), (6, -1.5, [])]
    assert echoed([4, 5], None) == [(4, None, None), (5, None, None)]


class _SentencePieceVocab:
    """The two calls TokenBytes makes of a SentencePiece tokenizer with byte fallback (Llama 2 style)."""

    pieces: ClassVar[dict[int, str]] = {0: "<s>", 1: "\u2581the", 2: "<0xE6>", 3: "<0x97>", 4: "<0xA5>", 5: "ly"}
    added_tokens_decoder: ClassVar[dict[int, str]] = {0: "<s>"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, ids: list[int]) -> str:
        raise AssertionError("every piece here has its bytes in the vocabulary")


def test_sentencepiece_byte_fallback_and_spaces() -> None:
    tokens = TokenBytes(_SentencePieceVocab())
    assert tokens.of(1) == (b" the", " the")
    assert tokens.of(5) == (b"ly", "ly")
    assert tokens.of(0) == (b"<s>", "<s>")
    assert b"".join(tokens.of(i)[0] for i in (1, 2, 3, 4)).decode("utf-8") == " the日"
    assert tokens.of(2)[1] == "bytes:\\xe6"
