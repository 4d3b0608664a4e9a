"""Bad requests get the right status and the OpenAI error shape; the server stays healthy."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers.server_process import ServerProcess, running_server
from helpers.tiny_server import TinyServer, build_tiny_chat_model

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--max-body-bytes", "65536", "--max-queued-requests", "2", "--request-timeout", "3") as proc:
        yield proc


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    """The same HTTP layer and limits around a tiny random model (helpers/tiny_server.py): for checks of status
    codes and error shapes, which do not depend on the default model's answers."""
    folder = build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")))
    with TinyServer(folder, max_body_bytes=65536, request_timeout=3) as running:
        yield running


LONG = "word " * 3000  # about 3000 tokens > max_model_len 2048

# (route, body or raw bytes, expected status, expected param or None)
CASES: list[tuple[str, Any, int, str | None]] = [
    (CHAT, {"messages": MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 10**9}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "temperature": -0.1}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": 150}, 400, "temperature"),  # past SamplingParams' own bound
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "", "content": "x"}]}, 400, "messages.0.role"),  # a custom role is the template's
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": MSG, "model": "gpt-9"}, 404, "model"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "prompt"),
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2, 3]", 400, None),
    (CHAT, {"messages": MSG, "n": 1000}, 400, "n"),
    (CHAT, {"messages": MSG, "stop": ["a"] * 40}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": [""]}, 400, "stop"),
    (CHAT, {"messages": MSG, "presence_penalty": 5}, 400, "presence_penalty"),
    (CHAT, {"messages": MSG, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "top_logprobs": 5}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "seed": 2**63}, 400, "seed"),  # int64 (negative seeds are valid, as in OpenAI)
    (CHAT, {"messages": MSG, "frobnicate": True}, 400, "frobnicate"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content",
    ),
    (COMPLETIONS, {"prompt": [1, 2, 999999]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [-1, 5]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2048}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": LONG}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": ["a"] * 40, "n": 2}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": {"nested": "object"}}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    (COMPLETIONS, {"prompt": [True, False]}, 400, "prompt"),
    (
        CHAT,
        {
            "messages": MSG,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
        },
        400,
        "response_format",
    ),
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, 400, "response_format"),
    (
        COMPLETIONS,
        {
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "array", "minItems": 3, "maxItems": 1}},
            },
        },
        400,
        "response_format",
    ),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, 400, "guided_regex"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"nom": "f"}}]}, 400, "tools"),
    (CHAT, {"messages": MSG, "tool_choice": "auto"}, 400, "tool_choice"),
    (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
    ),
    (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        400,
        "response_format",
    ),
    (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "response_format": {"type": "json_object"},
        },
        400,
        "response_format",
    ),
    (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
            "tool_choice": "required",
        },
        400,
        "tools",
    ),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, None),  # without stream
    (CHAT, b"", 400, None),
    (
        CHAT,
        {"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]},
        400,
        "messages.1",
    ),
    (COMPLETIONS, b"x" * 70000, 413, None),
    ("/v1/nonexistent", {}, 404, None),
]


@pytest.mark.parametrize(
    "route, body, status, param", CASES, ids=[f"{i}-{c[0].split('/')[-1]}-{c[2]}" for i, c in enumerate(CASES)]
)
def test_bad_request_table(server: ServerProcess, route: str, body: Any, status: int, param: str | None) -> None:
    if isinstance(body, bytes):
        r = server.http.post(server.url + route, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    else:
        r = server.http.post(server.url + route, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param or (error["param"] or "").startswith(param), error
    _no_internals(error["message"])
    assert server.http.get(server.url + "/health").status_code == 200


def _no_internals(message: str) -> None:
    assert "Traceback" not in message and not re.search(r"0x[0-9a-f]{6,}", message)
    assert ".py" not in message and "/site-packages" not in message


def test_one_bad_request_does_not_disturb_another(server: ServerProcess) -> None:
    import concurrent.futures as cf

    # 3 tokens: well inside this server's 3 s --request-timeout on a loaded machine too
    good = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0}
    with cf.ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(server.http.post, server.url + COMPLETIONS, json=good, timeout=60) for _ in range(2)]
        bads = [
            pool.submit(server.http.post, server.url + COMPLETIONS, json={"prompt": [10**8]}, timeout=60)
            for _ in range(6)
        ]
        answers = [f.result() for f in goods]
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        texts = {r.json()["choices"][0]["text"] for r in answers}
        assert all(f.result().status_code == 400 for f in bads)
    assert len(texts) == 1


def test_queue_full_gives_503_with_retry_after(server: ServerProcess) -> None:
    import concurrent.futures as cf

    # 2 tokens each: the admitted batch finishes well inside the 3 s deadline on a loaded machine too
    body = {"model": MODEL, "prompt": "Story:", "max_tokens": 2, "ignore_eos": True}
    with cf.ThreadPoolExecutor(40) as pool:
        results = list(
            pool.map(lambda _: server.http.post(server.url + COMPLETIONS, json=body, timeout=120), range(40))
        )
    refused = [r for r in results if r.status_code == 503]
    assert refused, "40 simultaneous requests with --max-queued-requests 2 should see a 503"
    assert all(r.headers.get("retry-after") and r.json()["error"]["code"] == "queue_full" for r in refused)
    assert any(r.status_code == 200 for r in results), [r.status_code for r in results]
    # This server runs with --request-timeout 3: on a loaded machine an admitted request may pass its deadline,
    # and then it must end as the documented 504 timeout error, never as anything else.
    timed_out = [r for r in results if r.status_code == 504]
    assert all(r.json()["error"]["type"] == "timeout_error" for r in timed_out), [r.text for r in timed_out]
    assert all(r.status_code in (200, 503, 504) for r in results), [(r.status_code, r.text) for r in results]
    assert server.http.get(server.url + "/health").status_code == 200


def _errors_counted(server: ServerProcess) -> float:
    text = server.http.get(server.url + "/metrics", timeout=10).text
    line = next((x for x in text.splitlines() if x.startswith('conveyor_requests_total{status="error"}')), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


def test_empty_or_form_body_says_to_send_json(server: ServerProcess) -> None:
    for headers in ({"Content-Type": "application/json"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        for content in (b"", b'{"prompt": "x"}'):
            r = server.http.post(server.url + COMPLETIONS, content=content, headers=headers, timeout=30)
            if content and headers["Content-Type"] == "application/json":
                continue  # a valid request
            assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"], r.text


def test_timeout_ends_with_an_error(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 1900, "ignore_eos": True}
    errors_before = _errors_counted(server)
    r = server.http.post(server.url + COMPLETIONS, json=body, timeout=60)
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    assert _errors_counted(server) == errors_before + 1
    with server.http.stream("POST", server.url + COMPLETIONS, json=body | {"stream": True}, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert "error" in json.loads(lines[-2][6:]) and "timed out" in lines[-2]
    time.sleep(0.5)
    assert server.http.get(server.url + "/health").status_code == 200


def test_schemathesis_finds_no_500(tiny_server: TinyServer) -> None:
    """Property-based fuzzing from the app's own OpenAPI schema (bounded), on the tiny model: every generated body
    goes through the same routes, validation and error handling, at a fraction of the default model's cost."""
    server = tiny_server
    http = httpx.Client()  # one for every generated request (httpx.post would build one, TLS context and all, each)
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures = []
    sent = []
    for op in schema.get_all_operations():
        operation = op.ok()
        if operation.method.upper() != "POST":
            continue
        strategy = operation.as_strategy()

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @__import__("hypothesis").given(case=strategy)
        def check(case: Any) -> None:
            body = case.body
            if isinstance(body, dict):  # keep generation cheap: cap tokens asked for
                for key in ("max_tokens", "max_completion_tokens"):
                    if isinstance(body.get(key), int) and body[key] > 8:
                        body[key] = 8
                body["n"] = 1 if isinstance(body.get("n"), int) else body.get("n", 1)
            r = http.post(server.url + case.formatted_path, json=body, timeout=60)
            sent.append(r.status_code)
            if r.status_code >= 500 and r.status_code != 503 and r.status_code != 504:
                failures.append((case.formatted_path, body, r.status_code, r.text[:300]))
            if r.status_code != 200 and r.headers.get("content-type", "").startswith("application/json"):
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}

        check()
    assert not failures, failures[:3]
    assert len(sent) >= 25, f"only {len(sent)} generated requests were sent"
    assert http.get(server.url + "/health").status_code == 200
    http.close()


def test_server_value_bounds_are_sampling_params_own() -> None:
    """One source for every value range: what the server's pydantic bodies accept at the edge of a
    range, SamplingParams accepts too, and one step past it both refuse."""
    import pydantic

    from conveyor.errors import InvalidRequestError
    from conveyor.params import SamplingParams
    from conveyor.server.protocol import ChatCompletionRequest, bounds

    messages = [{"role": "user", "content": "hi"}]
    for name, body_name in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("min_p", "min_p"),
        ("presence_penalty", "presence_penalty"),
        ("repetition_penalty", "repetition_penalty"),
        ("logprobs", "top_logprobs"),
    ):
        limits = bounds(name)
        top = limits.get("le")
        assert top is not None, name
        ChatCompletionRequest(messages=messages, **{body_name: top})
        SamplingParams(**{name: top})
        past = top + 1
        with pytest.raises(pydantic.ValidationError):
            ChatCompletionRequest(messages=messages, **{body_name: past})
        with pytest.raises(InvalidRequestError, match=name):
            SamplingParams(**{name: past})
