"""A server that never answers 500 to a client's mistake and never poisons a connection, against a real HTTP server
in this process around a tiny model (helpers/tiny_server.py): strict types (wrong JSON types from the server's own
schema, then hypothesis's bodies), lone surrogates named, NaN logits a 500 that says so, an unexpected exception a
JSON 500 after which the client's next request works, and a short soak."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from conveyor.bench.soak import SoakConfig, run_soak, text_report
from conveyor.bench.soak_bodies import CHAT, COMPLETIONS, wrong_type_cases
from conveyor.server.serving import Serving
from helpers.tiny_server import TinyServer, build_tiny_chat_model

MAX_BODY = 65536
POISON = 510
"""A token the tokenizer never produces (the model's vocabulary is wider): only token-id prompts reach it."""
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: Any) -> Iterator[TinyServer]:
    folder = build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat-server")))
    with TinyServer(folder, max_body_bytes=MAX_BODY) as running:
        yield running


@pytest.fixture(scope="module")
def openapi(server: TinyServer) -> dict[str, Any]:
    return httpx.get(server.url + "/openapi.json", timeout=30).json()


def _client(server: TinyServer) -> httpx.Client:
    """One keep-alive connection: a request after an error goes down the same connection unless it was closed."""
    return httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=1))


def _good(client: httpx.Client) -> None:
    r = client.post(COMPLETIONS, json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert (error["param"] or "").startswith(param), (param, error)
    return dict(error)


def test_wrong_json_types_are_a_400_naming_the_field(server: TinyServer, openapi: dict[str, Any]) -> None:
    """Every field of both generation bodies, with a value of each JSON type it does not take (true for a count,
    "1" for a number, 1 or "true" for a flag, ...): a 400 naming it, never a coercion; all down one connection."""
    cases = [(COMPLETIONS, *c) for c in wrong_type_cases(openapi, "CompletionRequest", {"prompt": "x"})]
    cases += [(CHAT, *c) for c in wrong_type_cases(openapi, "ChatCompletionRequest", {"messages": MSG})]
    assert len(cases) > 200
    with _client(server) as client:
        for route, field, body in cases:
            _error(client.post(route, json=body | {"max_tokens": 2} if field != "max_tokens" else body), 400, field)
        _good(client)


SURROGATES = [
    (COMPLETIONS, b'{"prompt": "caf\\ud800e"}', "prompt"),
    (COMPLETIONS, b'{"prompt": ["ok", "\\udfff"]}', "prompt.1"),
    (COMPLETIONS, b'{"prompt": "x", "stop": ["\\ud83d"]}', "stop.0"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi \\udc00"}]}', "messages.0.content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', "messages.0"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
]


def test_lone_surrogates_are_a_400_naming_the_field(server: TinyServer) -> None:
    with _client(server) as client:
        for route, raw, param in SURROGATES:
            r = client.post(route, content=raw, headers={"Content-Type": "application/json"})
            assert "not valid Unicode" in _error(r, 400, param)["message"]
        _good(client)
        emoji = b'{"prompt": "\\ud83d\\ude00 caf\\u00e9", "max_tokens": 2}'
        emoji_r = client.post(COMPLETIONS, content=emoji, headers={"Content-Type": "application/json"})
        assert emoji_r.status_code == 200  # a surrogate pair (an emoji's escape) is valid Unicode


def test_nan_logits_end_the_request_with_a_500_that_says_so(server: TinyServer) -> None:
    """A request whose logits come out NaN: a 500 with the message (code non_finite_logits), or, streamed, its
    choice's finish_reason "error" then the error event; counted in /metrics; a clean request beside it is served."""
    engine = server.engine()
    embed = engine.runner.model.embed
    original = embed[POISON].clone()
    counted = server.metric("conveyor_non_finite_requests_total")
    errors = server.metric('conveyor_requests_total{status="error"}') if _has_errors(server) else 0.0
    clean = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "logit_bias": {str(POISON): -100}}
    try:
        with torch.no_grad():
            embed[POISON] = float("nan")
        with _client(server) as client:
            error = _error(client.post(COMPLETIONS, json={"prompt": [5, POISON, 7], "max_tokens": 4}), 500)
            assert error["code"] == "non_finite_logits" and "not finite (NaN or infinity)" in error["message"]
            with client.stream("POST", COMPLETIONS, json={"prompt": [9, POISON], "max_tokens": 4, "stream": True}) as s:
                lines = [line for line in s.iter_lines() if line]
            assert s.status_code == 200 and lines[-1] == "data: [DONE]"
            assert json.loads(lines[-3][6:])["choices"][0]["finish_reason"] == "error"
            event = json.loads(lines[-2][6:])["error"]
            assert event["code"] == "non_finite_logits" and "not finite" in event["message"]
            assert client.post(COMPLETIONS, json=clean).status_code == 200
    finally:
        with torch.no_grad():
            embed[POISON] = original
    assert server.metric("conveyor_non_finite_requests_total") == counted + 2
    assert server.metric('conveyor_requests_total{status="error"}') == errors + 2


def _has_errors(server: TinyServer) -> bool:
    try:
        server.metric('conveyor_requests_total{status="error"}')
        return True
    except KeyError:
        return False


def test_an_unexpected_exception_is_a_json_500_and_the_next_request_works(
    server: TinyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Serving.prepare_completion

    async def failing(self: Serving, body: Any) -> Any:
        if body.prompt == "boom":
            raise RuntimeError("a bug")
        return await real(self, body)

    monkeypatch.setattr(Serving, "prepare_completion", failing)
    with _client(server) as client:
        for _ in range(3):
            r = client.post(COMPLETIONS, json={"prompt": "boom"})
            error = _error(r, 500)
            assert r.headers["connection"] == "close" and "a bug" not in error["message"]
            _good(client)


def test_no_error_poisons_the_connection(server: TinyServer) -> None:
    """Each kind of refusal, then a good request down the same keep-alive connection (or a new one where the
    server said Connection: close)."""
    json_type = {"Content-Type": "application/json"}
    refusals: list[tuple[str, bytes, int]] = [
        (COMPLETIONS, b"{not json", 400),
        (COMPLETIONS, b"[1, 2]", 400),
        (COMPLETIONS, b"", 400),
        (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400),
        (COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400),
        (COMPLETIONS, b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400),  # deeper than Python's json goes
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "x"}], "metadata": ' + b'{"a": ' * 500 + b"1" + b"}" * 501,
            400,
        ),
        (COMPLETIONS, b'{"prompt": "x", "model": "gpt-9"}', 404),
        ("/v1/nowhere", b"{}", 404),
        (COMPLETIONS, b'{"prompt": "' + b"x" * MAX_BODY + b'"}', 413),
        (COMPLETIONS, b'{"prompt": "' + b"x" * (64 * MAX_BODY) + b'"}', 413),  # still sending as the 413 leaves
    ]
    with _client(server) as client:
        for route, raw, status in refusals:
            _error(client.post(route, content=raw, headers=json_type), status)
            _good(client)
        chunks = (b"x" * 8192 for _ in range(2 * MAX_BODY // 8192))  # no Content-Length: the cap is found reading
        r = client.post(COMPLETIONS, content=chunks, headers=json_type)
        assert _error(r, 413)["code"] == "body_too_large"
        _good(client)
        with client.stream("POST", CHAT, json={"messages": MSG, "max_tokens": 50, "stream": True}) as s:
            next(s.iter_lines())  # the client leaves mid-stream
        _good(client)


EXTREMES: list[dict[str, Any]] = [
    {"top_k": 2**70},  # once overflowed the step's int64 tensor and stopped the engine for everyone
    {"top_k": 2**40, "temperature": 1.0},
    {"max_tokens": 2**70},
    {"min_tokens": 2**70},
    {"seed": -(2**63), "n": 2},
    {"logit_bias": {str(2**70): 1}},
    {"stop_token_ids": [2**70]},
    {"prompt": [2**70]},
    {"temperature": 1e-30},
    {"top_p": 1e-30},
    {"repetition_penalty": 1e-30},
    {"repetition_penalty": 5e-324},  # once divided logits into infinities (a 500 blaming the model)
    {"min_p": 1e-45},
    {"stop": ["\u0000"], "user": "\u0000"},
    {"logit_bias": {"-0": 1, "00005": 1}},
]


def test_extreme_values_are_served_or_refused(server: TinyServer) -> None:
    """Values at and past the ends of every range: a 200 or a 400, and the engine serves the next request."""
    with _client(server) as client:
        for extra in EXTREMES:
            r = client.post(COMPLETIONS, json={"prompt": "hello", "max_tokens": 3} | extra)
            assert r.status_code in (200, 400), (extra, r.text)
        _good(client)


def test_hypothesis_bodies_never_get_a_5xx(server: TinyServer, openapi: dict[str, Any]) -> None:
    """Bodies of any JSON values for the generation routes' fields (a few right, most wrong): never a 5xx, always
    OpenAI's error shape when refused."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
    values = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=6,
    )
    fields = {
        COMPLETIONS: sorted(openapi["components"]["schemas"]["CompletionRequest"]["properties"]),
        CHAT: sorted(openapi["components"]["schemas"]["ChatCompletionRequest"]["properties"]),
    }
    client = _client(server)

    @hypothesis.settings(max_examples=30, deadline=None, database=None, derandomize=True)
    @hypothesis.given(st.sampled_from(sorted(fields)), st.data())
    def check(route: str, data: Any) -> None:
        chosen = data.draw(st.lists(st.sampled_from(fields[route]), max_size=4, unique=True))
        body = {"prompt": "x"} if route == COMPLETIONS else {"messages": MSG}
        body |= {"max_tokens": 2} | {name: data.draw(values) for name in chosen}
        try:
            content = json.dumps(body).encode()
        except ValueError:
            return
        r = client.post(route, content=content, headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (body, r.text)
        if r.status_code != 200:
            _error(r, r.status_code)

    with client:
        check()
        _good(client)


def test_a_short_soak_passes(server: TinyServer) -> None:
    """The soak's client mix (conveyor bench soak) against this server for a few seconds: every well-formed
    request completed, every bad one refused with a 4xx, none lost, the server idle after, the greedy answer the
    same (the full-length soak runs in the slow tier and by hand: docs/server.md)."""
    config = SoakConfig(
        url=server.url,
        clients=4,
        duration_s=2.0,
        seed=0,
        server_pid=os.getpid(),
        max_body_bytes=MAX_BODY,
        max_model_len=512,
        long_tokens=300,
        rss_bound_mib=1024.0,  # this test process's own memory, with pytest's in it: not the bound this checks
    )
    result = asyncio.run(run_soak(config))
    assert result["passed"], text_report(result)
    assert result["requests"] >= 4 and result["well_formed"] > 0
