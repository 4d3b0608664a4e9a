"""The soak's requests: a mix of well-formed ones (streams, n > 1, logprobs, stops, seeds, structured output, long
prompts, clients that leave mid-stream) and malformed ones, each a client's mistake the server must answer with a
4xx and a JSON error body.

Wrong types come from the server's own OpenAPI schema (its request bodies' JSON types): for a field, a value of
every JSON type the field does not take (true for an integer, "1" for a number, 1 for a flag, ...), so a field
added to the API is covered without a change here. The tests draw their strict-type cases from here too.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
JSON_TYPES = ("boolean", "integer", "number", "string", "array", "object", "null")
SKIPPED_FIELDS = ("prompt_embeds",)
"""Fields of any JSON type (refused for any value but null by a validator: not a type question)."""
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Count from one to five.",
    "Write a haiku about rivers.",
    "What is two plus two?",
    "Say hello in Spanish.",
]
SENTENCE = "The quick brown fox jumps over the lazy dog while the river runs past the old mill. "
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "minimum": 1}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class SoakRequest:
    """One request of the soak: where it goes, its body (a dict sent as JSON, or raw bytes), what kind it is, and
    whether it is well-formed (must complete) or a client's mistake (must get a 4xx with a JSON body)."""

    kind: str
    route: str
    body: dict[str, Any] | bytes
    well_formed: bool
    stream: bool = False
    leave_after_chunks: int | None = None
    """A client that disconnects after this many stream chunks (well-formed; its request is aborted)."""

    def content(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def accepted_types(prop: dict[str, Any]) -> set[str] | None:
    """The JSON types one property of an OpenAPI schema takes (an integer counts as a number); None for any."""
    options = prop.get("anyOf", [prop])
    found: set[str] = set()
    for option in options:
        if "$ref" in option:
            found.add("object")
        elif "type" in option:
            found.add(option["type"])
        else:
            return None  # {}: any value
    if "number" in found:
        found.add("integer")
    return found


def field_types(openapi: dict[str, Any], schema: str) -> dict[str, set[str]]:
    """Field name -> the JSON types it takes, for one request body of the schema (fields of any type left out)."""
    props = openapi["components"]["schemas"][schema]["properties"]
    types = {name: accepted_types(prop) for name, prop in props.items() if name not in SKIPPED_FIELDS}
    return {name: kinds for name, kinds in types.items() if kinds is not None}


def wrong_value(json_type: str, accepted: set[str]) -> Any:
    """A value of `json_type` that looks closest to what the field takes (a numeric string for a number, "true"
    for a flag): what lax parsing would coerce, so strictness shows."""
    if json_type == "string":
        return "true" if "boolean" in accepted else "1" if accepted & {"integer", "number"} else "x"
    return {
        "boolean": True,
        "integer": 1,
        "number": 1.5,
        "array": [1],
        "object": {"a": 1},
        "null": None,
    }[json_type]


def wrong_type_cases(openapi: dict[str, Any], schema: str, valid: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(field, body): `valid` with one field set to a value of a JSON type the field does not take, for every
    field and every such type."""
    cases = []
    for name, accepted in field_types(openapi, schema).items():
        for json_type in JSON_TYPES:
            if json_type not in accepted:
                cases.append((name, valid | {name: wrong_value(json_type, accepted)}))
    return cases


def long_prompt(tokens_per_sentence: float, tokens: int) -> str:
    """About `tokens` tokens of text (the soak measures tokens_per_sentence with the server's /tokenize)."""
    return SENTENCE * max(1, round(tokens / tokens_per_sentence))


class SoakMix:
    """Draws the soak's requests: `bad_share` of them malformed, the rest well-formed of every kind."""

    WELL_FORMED = ("plain", "stream", "n", "logprobs", "stop", "seed", "structured", "long", "disconnect")
    MALFORMED = (
        "invalid_json",
        "not_an_object",
        "empty",
        "wrong_type",
        "surrogate",
        "unknown_field",
        "nan",
        "not_utf8",
        "out_of_range",
        "too_long",
        "unknown_model",
        "oversized",
        "deep_nesting",
    )

    def __init__(
        self,
        openapi: dict[str, Any],
        tokens_per_sentence: float,
        max_model_len: int,
        max_body_bytes: int,
        long_tokens: int = 3000,
        bad_share: float = 0.2,
        long_share: float = 0.04,
    ) -> None:
        self.wrong_types = wrong_type_cases(openapi, "CompletionRequest", _completion("x", 4)) + wrong_type_cases(
            openapi, "ChatCompletionRequest", _chat("x", 4)
        )
        self.long_text = long_prompt(tokens_per_sentence, long_tokens)
        self.too_long_text = long_prompt(tokens_per_sentence, max_model_len + 200)
        self.max_body_bytes = max_body_bytes
        self.bad_share, self.long_share = bad_share, long_share

    def every_kind(self, rng: random.Random) -> list[SoakRequest]:
        """One request of each kind, well-formed and malformed: the soak sends these first (spread over its
        clients), so that a short run covers every kind too."""
        return [self.well_formed(k, rng) for k in self.WELL_FORMED] + [self.malformed(k, rng) for k in self.MALFORMED]

    def draw(self, rng: random.Random) -> SoakRequest:
        if rng.random() < self.bad_share:
            return self.malformed(rng.choice(self.MALFORMED), rng)
        if rng.random() < self.long_share:
            return self.well_formed("long", rng)
        return self.well_formed(rng.choice([k for k in self.WELL_FORMED if k != "long"]), rng)

    def well_formed(self, kind: str, rng: random.Random) -> SoakRequest:
        question = rng.choice(QUESTIONS)
        tokens = rng.randint(8, 48)
        if kind == "plain":
            return SoakRequest(kind, COMPLETIONS, _completion(question, tokens, temperature=rng.random()), True)
        if kind == "stream":
            body = _chat(question, tokens, stream=True, stream_options={"include_usage": True})
            return SoakRequest(kind, CHAT, body, True, stream=True)
        if kind == "n":
            return SoakRequest(kind, CHAT, _chat(question, tokens, n=rng.randint(2, 3), seed=rng.randint(0, 99)), True)
        if kind == "logprobs":
            if rng.random() < 0.5:
                return SoakRequest(kind, COMPLETIONS, _completion(question, tokens, logprobs=2, echo=True), True)
            return SoakRequest(kind, CHAT, _chat(question, tokens, logprobs=True, top_logprobs=3), True)
        if kind == "stop":
            body = _completion(question, tokens, stop=[" the", ".", "\n"], stream=rng.random() < 0.5)
            return SoakRequest(kind, COMPLETIONS, body, True, stream=bool(body["stream"]))
        if kind == "seed":
            body = _chat(question, tokens, temperature=0.9, top_p=0.9, top_k=40, seed=rng.randint(-(2**40), 2**40))
            return SoakRequest(kind, CHAT, body, True)
        if kind == "structured":
            format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
            return SoakRequest(kind, CHAT, _chat(question, 40, response_format=format_), True)
        if kind == "long":
            body = _completion(self.long_text, rng.randint(4, 16), stream=rng.random() < 0.5)
            return SoakRequest(kind, COMPLETIONS, body, True, stream=bool(body["stream"]))
        if kind == "disconnect":
            body = _chat(question, 64, stream=True, ignore_eos=True)
            return SoakRequest(kind, CHAT, body, True, stream=True, leave_after_chunks=rng.randint(1, 4))
        raise ValueError(f"unknown well-formed kind {kind!r}; the kinds are {self.WELL_FORMED}")

    def malformed(self, kind: str, rng: random.Random) -> SoakRequest:
        question = rng.choice(QUESTIONS)
        raw: bytes | None = None
        route, body = COMPLETIONS, _completion(question, 8)
        if kind == "invalid_json":
            raw = b'{"prompt": "unclosed'
        elif kind == "not_an_object":
            raw = rng.choice([b"[1, 2, 3]", b"null", b'"prompt"', b"42"])
        elif kind == "empty":
            raw = b""
        elif kind == "wrong_type":
            _, body = rng.choice(self.wrong_types)
            route = CHAT if "messages" in body else COMPLETIONS
        elif kind == "surrogate":
            if rng.random() < 0.5:
                raw = b'{"prompt": "caf\\ud800e", "max_tokens": 4}'
            else:
                raw = b'{"messages": [{"role": "user", "content": "x\\udc00"}], "max_tokens": 4}'
                route = CHAT
        elif kind == "unknown_field":
            body = body | {"frobnicate": True}
        elif kind == "nan":
            raw = b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}'
        elif kind == "not_utf8":
            raw = b'{"prompt": "\xff\xfe caf\xe9", "max_tokens": 4}'
        elif kind == "out_of_range":
            body = body | rng.choice([{"max_tokens": -1}, {"n": 1000}, {"top_p": 0}, {"temperature": -1}])
        elif kind == "too_long":
            body = _completion(self.too_long_text, 4)
        elif kind == "unknown_model":
            body = body | {"model": "no-such-model"}
        elif kind == "deep_nesting":
            depth = rng.choice([500, 20000])  # within Python's json's reach, and past it
            raw = b'{"prompt": "hi", "max_tokens": 4, "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        elif kind == "oversized":
            raw = b'{"prompt": "' + b"x" * (self.max_body_bytes + 1024) + b'"}'
        else:
            raise ValueError(f"unknown malformed kind {kind!r}; the kinds are {self.MALFORMED}")
        if raw is not None:
            return SoakRequest(kind, route, raw, False)
        return SoakRequest(kind, route, body, False)


def _completion(prompt: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens} | fields


def _chat(question: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens} | fields
