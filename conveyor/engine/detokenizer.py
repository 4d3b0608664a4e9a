"""Incremental detokenizer: text grows token by token, and ends equal to a full decode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

_CONTEXT_TOKENS = 5


def window_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The decode a detokenizer calls twice per token. For a plain tokenizers-backed tokenizer that
    does not clean up spaces, transformers' `decode` is exactly `backend_tokenizer.decode` behind
    input conversion that costs several times the decode itself (a large share of the host's commit), so
    that one is called directly; any other tokenizer (a subclass with its own `_decode`, space clean-up
    on, a slow tokenizer) goes through its `decode`."""
    kind = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and kind._decode is TokenizersBackend._decode
        and kind.decode is PreTrainedTokenizerBase.decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    if plain:
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Decodes a window that starts a few tokens back, so spacing and multi-byte
    characters split across tokens come out right; holds text back while it ends in an
    incomplete character (U+FFFD)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.num_context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._decode: Callable[[list[int]], str] | None = (
            window_decoder(tokenizer, skip_special_tokens) if tokenizer is not None else None
        )

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (maybe empty)."""
        self.ids.append(token_id)
        if self._decode is None:  # no tokenizer
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flush the held-back tail (decoded with its context window, like every other piece),
        so the final text is the streamed text plus that tail; returns the tail."""
        if self._decode is None or self.read_offset >= len(self.ids):  # no tokenizer, or nothing held back
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
