"""Logprobs in the OpenAI shapes, with each token's raw bytes.

A token can be part of a character: byte-level BPE splits an emoji or a CJK character into
tokens of one to three bytes each. Decoding such a token on its own gives U+FFFD, which loses
the bytes, so the bytes come from the token's vocabulary entry instead:
- byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen): each character of the entry stands for one byte
  (transformers' `bytes_to_unicode` table);
- SentencePiece byte fallback (Llama 2, Mistral): `<0xNN>` entries are one byte, and U+2581 is a space;
- added and special tokens: their text, in UTF-8.
A token whose bytes are not valid UTF-8 on their own is shown as `bytes:\\xNN...`, as OpenAI does;
joining the `bytes` of consecutive tokens rebuilds the text.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from conveyor.core.plan import TokenLogprobs

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"

Entry = tuple[int, float | None, list[tuple[int, float]] | None]
"""(token id, its logprob or None, the top alternatives or None): one position of a logprobs list."""


class TokenBytes:
    """Token id -> (raw bytes, display text), for one tokenizer; remembers what it computed."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._cache: dict[int, tuple[bytes, str]] = {}

    def of(self, token_id: int) -> tuple[bytes, str]:
        """-> (the token's bytes, its text: the bytes as UTF-8, or `bytes:\\xNN...` where they are not)."""
        found = self._cache.get(token_id)
        if found is None:
            raw = self._raw(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._cache[token_id] = (raw, text)
        return found

    def _raw(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and piece and all(c in self._byte_of for c in piece):
                return bytes(self._byte_of[c] for c in piece)
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
            if not self._byte_level:
                return piece.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")
        return str(self.tokenizer.decode([token_id])).encode("utf-8")


def _is_byte_level(tokenizer: Any) -> bool:
    """The fast tokenizer's decoder (or one step of it) is ByteLevel."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    steps = decoder.get("decoders") or [decoder]
    return any(isinstance(s, dict) and s.get("type") == "ByteLevel" for s in steps)


def generated(lps: Sequence[TokenLogprobs]) -> list[Entry]:
    return [(lp.token_id, lp.logprob, lp.top) for lp in lps]


def echoed(
    prompt_ids: Sequence[int], prompt_lps: Sequence[TokenLogprobs | None] | None, top: int | None = None
) -> list[Entry]:
    """The prompt's positions: the first has no logprob (nothing precedes it). top: alternatives kept per
    position (the engine computed more when prompt_logprobs asked for more than logprobs)."""
    lps = list(prompt_lps or [])
    entries: list[Entry] = []
    for j, token_id in enumerate(prompt_ids):
        lp = lps[j] if j < len(lps) else None
        entries.append((token_id, None, None) if lp is None else (token_id, lp.logprob, lp.top[:top]))
    return entries


class TextOffsets:
    """Characters before each token of one choice, counted from the tokens' own bytes (a character counts
    where its last byte arrives), so that streamed chunks continue where the previous one stopped even
    while text is held back."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")

    def advance(self, raw: bytes) -> int:
        """-> the offset of a token with these bytes; moves past it."""
        offset = self.chars
        self.chars += len(self._decoder.decode(raw))
        return offset


def completion_logprobs(
    tokens: TokenBytes | None, entries: list[Entry], offsets: TextOffsets | None = None
) -> dict[str, Any]:
    """/v1/completions `logprobs`; offsets: the choice's running count when it is streamed in chunks."""

    def name(token_id: int) -> str:
        return tokens.of(token_id)[1] if tokens else str(token_id)

    texts = [name(t) for t, _, _ in entries]
    counter = offsets if offsets is not None else TextOffsets()
    return {
        "tokens": texts,
        "token_logprobs": [lp for _, lp, _ in entries],
        # the chosen token first, then the top-N: up to N + 1 entries (OpenAI's legacy API and vLLM do so)
        "top_logprobs": [None if top is None else {name(i): v for i, v in [(t, lp), *top]} for t, lp, top in entries],
        "text_offset": [counter.advance(tokens.of(t)[0] if tokens else str(t).encode()) for t, _, _ in entries],
    }


def chat_logprobs(tokens: TokenBytes | None, entries: list[Entry]) -> dict[str, Any]:
    """/v1/chat/completions `logprobs`: each token with its bytes and its top alternatives."""

    def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
        if tokens is None:
            return {"token": str(token_id), "logprob": logprob, "bytes": None}
        raw, text = tokens.of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in top or []]} for t, lp, top in entries]}
