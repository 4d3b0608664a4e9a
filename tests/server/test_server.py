"""A real server process on loopback, driven by the real `openai` client, httpx and curl-like calls."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from conveyor import SamplingParams
from helpers.server_process import ServerProcess, running_server

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(
        "--api-key",
        KEY,
        "--allowed-origins",
        "http://allowed.example",
        "--dtype",
        "float32",
        "--max-queued-requests",
        "64",
        "--request-timeout",
        "120",
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat_prompt(default_llm: Any, content: str) -> str:
    return default_llm.apply_chat_template([{"role": "user", "content": content}])


def test_chat_matches_offline_generate(client: openai.OpenAI, default_llm: Any) -> None:
    question = "What is the capital of France?"
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=40, temperature=0
    )
    offline = default_llm.generate(
        [_chat_prompt(default_llm, question)], SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False
    )[0]
    assert reply.choices[0].message.content == offline.outputs[0].text
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_completion_stream_matches_non_stream_and_offline(client: openai.OpenAI, default_llm: Any) -> None:
    prompt = "The quick brown fox"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    offline = default_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    assert full.choices[0].text == streamed == offline.outputs[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_stream_with_n_and_stop(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to ten."}],
        max_tokens=40,
        temperature=0.8,
        seed=5,
        n=2,
        stop=["5"],
        stream=True,
    )
    texts: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str | None] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert set(reasons) == {0, 1}
    assert all("5" not in t for t in texts.values())


def test_streamed_choices_end_once_each(client: openai.OpenAI) -> None:
    for stream in (
        client.completions.create(model=MODEL, prompt="Say", max_tokens=8, n=3, temperature=1.0, seed=3, stream=True),
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=8,
            n=3,
            temperature=1.0,
            seed=3,
            stream=True,
        ),
    ):
        ends = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason is not None]
        assert sorted(ends) == [0, 1, 2]


def test_n_and_seed_non_streaming(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42, n=3)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert len(a.choices) == 3 and [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1, "each sample must have its own random stream"


def test_logprobs_shapes(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=2)
    assert len(completion.choices[0].logprobs.token_logprobs) == 4


def test_models_version_health(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.head(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == MODEL
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json() == models  # `created` does not move
    assert client.models.retrieve(MODEL).model_dump(exclude_unset=True) == models["data"][0]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert "version" in httpx.get(server.url + "/version", headers=AUTH).json()


def test_echo_gives_the_prompt_and_its_logprobs(client: openai.OpenAI, default_llm: Any) -> None:
    prompt = "The capital of France is"
    ask = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    plain = client.completions.create(**ask)
    echo = client.completions.create(**ask, echo=True)
    assert echo.choices[0].text == prompt + plain.choices[0].text
    offline = default_llm.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2), use_tqdm=False
    )[0]
    n_prompt = len(offline.prompt_token_ids)
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 5 and "".join(lp.tokens) == echo.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx([x.logprob for x in offline.prompt_logprobs[1:]], abs=1e-4)
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    assert echo.usage.completion_tokens == 5 and echo.usage.prompt_tokens == n_prompt
    # the same, streamed: the echo comes first, offsets run on across chunks
    chunks = list(client.completions.create(**ask, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == echo.choices[0].text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    streamed = list(client.completions.create(**ask, stream=True))
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == plain.choices[0].logprobs.text_offset
    held = dict(ask, max_tokens=12, stop=["zzzz"])  # a stop string holds text back while streaming
    whole = client.completions.create(**held).choices[0].logprobs
    pieces = list(client.completions.create(**held, stream=True))
    assert [o for c in pieces for o in c.choices[0].logprobs.text_offset] == whole.text_offset
    assert [t for c in pieces for t in c.choices[0].logprobs.tokens] == whole.tokens
    # max_tokens=0 with echo scores the prompt without generating
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-5)
    scored_chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in scored_chunks) == prompt
    assert scored_chunks[-1].choices[0].finish_reason == "length"


def test_neutral_values_of_unsupported_openai_fields_are_accepted(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            temperature=0,
            stream=True,
            response_format={"type": "text"},
            tool_choice="none",
            parallel_tool_calls=False,
            store=False,
            metadata={"team": "a"},
            service_tier="auto",
            stream_options={"include_usage": True, "include_obfuscation": False},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    for entry in reply.choices[0].logprobs.content:  # bytes are the token's own, its text where valid UTF-8
        assert entry.bytes is not None and all(0 <= b < 256 for b in entry.bytes)
        assert entry.token.startswith("bytes:") or bytes(entry.bytes).decode("utf-8") == entry.token


def _stream_lines(server: ServerProcess, body: dict[str, Any]) -> Iterator[str]:
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        yield from r.iter_lines()


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: ServerProcess) -> None:
    total = server.metric("conveyor_kv_cache_total_blocks", AUTH)
    body = {
        "model": MODEL,
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    lines = _stream_lines(server, body)
    for _ in range(5):
        next(lines)
    assert server.metric("conveyor_num_requests_running", AUTH) >= 1
    lines.close()  # the client goes away mid-stream
    deadline = time.time() + 10.0  # the abort lands within a step or two; a loaded machine needs more than 1 s
    while time.time() < deadline:
        if (
            server.metric("conveyor_kv_cache_free_blocks", AUTH) == total
            and server.metric("conveyor_num_requests_running", AUTH) == 0
        ):
            break
        time.sleep(0.05)
    assert server.metric("conveyor_num_requests_running", AUTH) == 0
    assert server.metric("conveyor_kv_cache_free_blocks", AUTH) == total


def test_disconnect_non_streaming_aborts(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 1500, "ignore_eos": True}

    def call() -> None:
        try:
            httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.8)
        except httpx.TimeoutException:
            pass

    t = threading.Thread(target=call)
    t.start()
    t.join()
    deadline = time.time() + 10.0  # 1500 tokens would take minutes: ending within seconds means it was aborted
    while time.time() < deadline and server.metric("conveyor_num_requests_running", AUTH) > 0:
        time.sleep(0.05)
    assert server.metric("conveyor_num_requests_running", AUTH) == 0


def test_metrics_exposes_the_required_series(server: ServerProcess) -> None:
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    for name in (
        "conveyor_num_requests_running",
        "conveyor_num_requests_waiting",
        "conveyor_kv_cache_usage_ratio",
        "conveyor_prefix_cache_hit_rate",
        "conveyor_time_to_first_token_seconds_bucket",
        "conveyor_inter_token_latency_seconds_bucket",
        "conveyor_e2e_request_latency_seconds_bucket",
        "conveyor_prompt_tokens_total",
        "conveyor_generation_tokens_total",
    ):
        assert name in text, name


def test_auth_on_every_route(server: ServerProcess) -> None:
    from conveyor.config import EngineConfig
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.server.app import build_app
    from conveyor.server.guard import OPEN_PATHS
    from conveyor.server.state import ServerOptions, ServerState
    from conveyor.server.ui import is_page_path

    app = build_app(ServerState(AsyncEngine(EngineConfig()), ServerOptions("m")))  # routes only, engine unstarted
    routes = [(r.path, m) for r in app.routes for m in getattr(r, "methods", ()) if m in ("GET", "POST")]
    assert len(routes) >= 6
    for path, method in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, headers=headers, json={} if method == "POST" else None)
            if path in OPEN_PATHS or is_page_path(path):  # probes, Prometheus scrapes, the page (holds no secret)
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "authentication_error"
        ok = httpx.request(method, server.url + path, headers=AUTH, json={} if method == "POST" else None)
        assert ok.status_code != 401
    # decided on the raw path: tricks do not bypass it
    for path in ("/health/../v1/models", "/v1/models?x=/health", "//v1/models", "/Health"):
        assert httpx.get(server.url + path).status_code in (401, 404)


def test_cors(server: ServerProcess) -> None:
    pre = httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            "Origin": "http://allowed.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.headers.get("access-control-allow-origin") == "http://allowed.example"
    evil = httpx.options(
        server.url + "/v1/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert evil.headers.get("access-control-allow-origin") is None
    plain = httpx.get(server.url + "/v1/models", headers=AUTH | {"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in plain.headers


def test_curl_like_raw_sse(server: ServerProcess) -> None:
    lines = [
        line
        for line in _stream_lines(server, {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True})
        if line
    ]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_omitted_sampling_fields_use_the_models_recommended_defaults(client: openai.OpenAI, default_llm: Any) -> None:
    from conveyor.model.loader import DEFAULT_MODEL_SAMPLING

    question = "Name a fruit."
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=20, seed=9
    )
    offline = default_llm.generate(
        [_chat_prompt(default_llm, question)],
        SamplingParams(max_tokens=20, seed=9, **DEFAULT_MODEL_SAMPLING),
        use_tqdm=False,
    )[0]
    assert reply.choices[0].message.content == offline.outputs[0].text
