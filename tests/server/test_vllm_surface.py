"""vLLM's request and server surface, each expectation written from what vLLM's server does, against real servers in
this process around a tiny model (helpers/tiny_server.py): chat_template_kwargs, custom roles, /tokenize with tools,
truncate_prompt_tokens, the null fields vLLM always sends, stream usage as vLLM decides it, tool_choice "required"
cut short, --root-path, --enable-force-include-usage, --return-tokens-as-token-ids, --enable-prompt-tokens-details,
/ping, /invocations, the LoRA routes, vLLM's metric series and a 503 for requests the shutdown ends."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from conveyor.config import EngineConfig
from conveyor.server.main import DrainingServer
from conveyor.server.vllm_metrics import export_vllm_names
from helpers.tiny_server import TinyServer, build_tiny_chat_model

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TEMPLATE = (
    "{% if tools %}<s>tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: "
    "{% if enable_thinking is defined and not enable_thinking %}no thinking. {% endif %}{% endif %}"
)
"""The tiny model's template, plus what Qwen3's does with enable_thinking and a tools list (so tools are native)."""
MSG = [{"role": "user", "content": "hello there"}]
KEY = "sk-test"
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: Any) -> str:
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-vllm-surface")), chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(folder: str) -> Any:
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def server(folder: str) -> Iterator[TinyServer]:
    with TinyServer(folder) as running:
        yield running


@pytest.fixture(scope="module")
def flagged(folder: str) -> Iterator[TinyServer]:
    """--root-path /llm, --enable-force-include-usage, --return-tokens-as-token-ids, --enable-prompt-tokens-details,
    --api-key and --vllm-metrics."""
    running = TinyServer(
        folder,
        root_path="/llm",
        force_include_usage=True,
        return_tokens_as_token_ids=True,
        prompt_tokens_details=True,
        api_keys=(KEY,),
    )
    export_vllm_names(running.metrics, "tiny", EngineConfig(max_model_len=512, block_size=8))
    with running:
        yield running


def _post(server: TinyServer, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kwargs)


def _sse(server: TinyServer, path: str, body: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json=body | {"stream": True}, timeout=120, **kwargs) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.strip()]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def _error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    return error


def _tokenize(server: TinyServer, body: dict[str, Any]) -> list[int]:
    response = _post(server, "/tokenize", body)
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


# ---- the request surface --------------------------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(server: TinyServer, tokenizer: Any) -> None:
    thinking_off = {"enable_thinking": False}
    rendered = tokenizer.apply_chat_template(MSG, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert rendered.endswith("assistant: no thinking. ")
    expected = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert _tokenize(server, {"messages": MSG, "chat_template_kwargs": thinking_off}) == expected
    reply = _post(
        server,
        CHAT,
        {"messages": MSG, "max_tokens": 2, "return_token_ids": True, "chat_template_kwargs": thinking_off},
    ).json()
    assert reply["prompt_token_ids"] == expected
    # a variable the template does not read is the template's business: the same prompt as without it
    plain = _tokenize(server, {"messages": MSG})
    assert _tokenize(server, {"messages": MSG, "chat_template_kwargs": {"not_read": [1, 2]}}) == plain != expected
    # what the server sets itself is refused by name; so is add_generation_prompt disagreeing with the request's
    _error(
        _post(server, CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}),
        400,
        "chat_template_kwargs.tokenize",
    )
    _error(
        _post(server, CHAT, {"messages": MSG, "chat_template_kwargs": {"tools": []}}), 400, "chat_template_kwargs.tools"
    )
    disagree = {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}}
    _error(_post(server, CHAT, disagree), 400, "chat_template_kwargs.add_generation_prompt")
    agree = {"messages": MSG, "max_tokens": 1, "chat_template_kwargs": {"add_generation_prompt": True}}
    assert _post(server, CHAT, agree).status_code == 200


def test_generation_prompt_combinations_as_vllm_validates_them(server: TinyServer, tokenizer: Any) -> None:
    turns = [*MSG, {"role": "assistant", "content": "Hi, I am"}]
    both = {"messages": turns, "continue_final_message": True, "add_generation_prompt": True}
    _error(_post(server, CHAT, both), 400, "continue_final_message")
    _error(_post(server, "/tokenize", both), 400, "continue_final_message")
    continued = tokenizer.apply_chat_template(turns, tokenize=False, continue_final_message=True)
    ids = tokenizer(continued, add_special_tokens=False)["input_ids"]
    for body in ({"continue_final_message": True, "add_generation_prompt": False}, {"continue_final_message": True}):
        reply = _post(server, CHAT, {"messages": turns, "max_tokens": 2, "return_token_ids": True} | body).json()
        assert reply["prompt_token_ids"] == ids


def test_custom_roles_reach_the_template(server: TinyServer, tokenizer: Any) -> None:
    messages = [{"role": "critic", "content": "be brief"}, *MSG]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<s>critic: be brief" in text
    assert _tokenize(server, {"messages": messages}) == tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = _post(server, CHAT, {"messages": messages, "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    # with add_generation_prompt off the reply takes the last message's role, a custom one too (as vLLM)
    last = _post(server, CHAT, {"messages": messages[:1], "max_tokens": 2, "add_generation_prompt": False}).json()
    assert last["choices"][0]["message"]["role"] == "critic"
    _error(_post(server, CHAT, {"messages": [{"role": "", "content": "x"}]}), 400, "messages.0.role")


def test_tokenize_with_tools(server: TinyServer, tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(MSG, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s>tools: f ")
    with_tools = _tokenize(server, {"messages": MSG, "tools": [TOOL]})
    assert with_tools == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(with_tools) > len(_tokenize(server, {"messages": MSG}))
    reply = _post(server, CHAT, {"messages": MSG, "tools": [TOOL], "max_tokens": 1, "return_token_ids": True})
    assert reply.json()["prompt_token_ids"] == with_tools  # what a chat completion with the tools renders
    _error(_post(server, "/tokenize", {"prompt": "x", "tools": [TOOL]}), 400)
    _error(_post(server, "/tokenize", {"messages": MSG, "tools": [{"type": "function"}]}), 400, "tools")


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: TinyServer, tokenizer: Any) -> None:
    ids = list(range(10, 60))
    base = {"prompt": ids, "max_tokens": 2, "return_token_ids": True}
    left = _post(server, COMPLETIONS, base | {"truncate_prompt_tokens": 7}).json()
    assert left["choices"][0]["prompt_token_ids"] == ids[-7:] and left["usage"]["prompt_tokens"] == 7
    right = _post(server, COMPLETIONS, base | {"truncate_prompt_tokens": 7, "truncation_side": "right"}).json()
    assert right["choices"][0]["prompt_token_ids"] == ids[:7]
    whole = _post(server, COMPLETIONS, base | {"truncate_prompt_tokens": 100}).json()
    assert whole["choices"][0]["prompt_token_ids"] == ids  # shorter than k: kept whole
    # -1: as many as the 512-token context leaves after max_tokens
    long = [10 + i % 400 for i in range(600)]
    most = _post(
        server, COMPLETIONS, {"prompt": long, "max_tokens": 5, "truncate_prompt_tokens": -1, "return_token_ids": True}
    )
    assert most.json()["choices"][0]["prompt_token_ids"] == long[-507:]
    _error(_post(server, COMPLETIONS, {"prompt": long, "max_tokens": 5}), 400, "prompt")  # without it: too long
    _error(
        _post(server, COMPLETIONS, base | {"truncate_prompt_tokens": 508, "max_tokens": 5}),
        400,
        "truncate_prompt_tokens",
    )
    _error(_post(server, COMPLETIONS, base | {"truncate_prompt_tokens": -2}), 400, "truncate_prompt_tokens")
    # chat: the rendered conversation's last tokens
    full = _tokenize(server, {"messages": MSG})
    chat = _post(
        server, CHAT, {"messages": MSG, "max_tokens": 1, "truncate_prompt_tokens": 4, "return_token_ids": True}
    )
    assert chat.json()["prompt_token_ids"] == full[-4:]


def test_whole_responses_carry_vllms_null_fields(server: TinyServer) -> None:
    choice = _post(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 2}).json()["choices"][0]
    assert choice["prompt_logprobs"] is None and choice["prompt_token_ids"] is None and choice["token_ids"] is None
    chat = _post(server, CHAT, {"messages": MSG, "max_tokens": 2}).json()
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    assert chat["choices"][0]["token_ids"] is None
    asked = _post(server, CHAT, {"messages": MSG, "max_tokens": 2, "return_token_ids": True, "prompt_logprobs": 1})
    assert asked.json()["prompt_token_ids"] and asked.json()["prompt_logprobs"][0] is None


def test_stream_usage_as_vllm_decides_it(server: TinyServer) -> None:
    body = {"messages": MSG, "max_tokens": 4, "ignore_eos": True}
    for options, final, every in (
        (None, False, False),
        ({"include_usage": False, "continuous_usage_stats": True}, False, False),  # no usage at all, as vLLM
        ({"include_usage": True}, True, False),
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
    ):
        for path, request in ((CHAT, body), (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "ignore_eos": True})):
            chunks = _sse(server, path, request | ({"stream_options": options} if options else {}))
            with_choices = [c for c in chunks if c["choices"]]
            assert all(("usage" in c) == every for c in with_choices), (path, options)
            assert (chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4) == final
            if every:
                assert with_choices[-1]["usage"]["completion_tokens"] == 4


def _no_end_token_ids(tokenizer: Any) -> dict[str, float]:
    """logit_bias that forbids every token ending the array: the constrained reply can only add call after call."""
    return {str(i): -100 for i in range(len(tokenizer)) if "]" in tokenizer.decode([i])}


def test_tool_choice_required_cut_short_keeps_the_complete_calls(server: TinyServer, tokenizer: Any) -> None:
    body = {
        "messages": MSG,
        "tools": [TOOL],
        "tool_choice": "required",
        "max_tokens": 60,
        "temperature": 0,
        "logit_bias": _no_end_token_ids(tokenizer),
        "return_token_ids": True,
    }
    reply = _post(server, CHAT, body).json()
    choice = reply["choices"][0]
    choice_text = tokenizer.decode(choice["token_ids"])
    complete = re.findall(r'\{\s*"name"\s*:\s*"f"\s*,\s*"arguments"\s*:\s*\{\s*\}\s*\}', choice_text)
    assert choice_text.startswith("[") and not choice_text.rstrip().endswith("]") and len(complete) >= 1
    assert choice["finish_reason"] == "length"  # as vLLM: not "tool_calls", the reply was cut short
    assert choice["message"]["content"] == ""
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {})] * len(
        complete
    )
    chunks = _sse(server, CHAT, body)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert all(not d["delta"].get("content") for d in deltas)
    headers = [t for d in deltas for t in d["delta"].get("tool_calls", []) if "id" in t]
    assert [t["function"]["name"] for t in headers] == ["f"] * len(complete)
    assert deltas[-1]["finish_reason"] == "length"


# ---- the server surface ---------------------------------------------------------------------------------------


def test_root_path_serves_under_the_prefix_and_without_it(flagged: TinyServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    for prefix in ("", "/llm"):
        assert httpx.get(flagged.url + prefix + "/v1/models", headers=auth, timeout=30).status_code == 200
        assert httpx.get(flagged.url + prefix + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(flagged.url + prefix + "/health", timeout=30).status_code == 200  # probes need no key
        assert httpx.get(flagged.url + prefix + "/ping", timeout=30).status_code == 200
        reply = _post(flagged, prefix + CHAT, {"messages": MSG, "max_tokens": 2}, headers=auth)
        assert reply.status_code == 200, reply.text
    schema = httpx.get(flagged.url + "/llm/openapi.json", headers=auth, timeout=30).json()
    assert schema["servers"] == [{"url": "/llm"}]
    page = httpx.get(flagged.url + "/llm/", timeout=30).text  # the web page: its URLs relative to the prefix
    assert '<base href="/llm/">' in page and 'src="ui/main.js"' in page
    assert httpx.get(flagged.url + "/llm/ui/main.js", timeout=30).status_code == 200


def test_force_include_usage_and_prompt_tokens_details(flagged: TinyServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    prompt = "a prompt of more than one KV block, so that the prefix cache can serve part of it the second time"
    for path, body in ((CHAT, {"messages": [{"role": "user", "content": prompt}]}), (COMPLETIONS, {"prompt": prompt})):
        chunks = _sse(flagged, path, body | {"max_tokens": 3, "ignore_eos": True}, headers=auth)  # no stream_options
        assert all("usage" in c for c in chunks)  # as vLLM's --enable-force-include-usage: every chunk
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert counts == sorted(counts) and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 3 and "prompt_tokens_details" in chunks[-1]["usage"]
        again = _post(flagged, path, body | {"max_tokens": 3}, headers=auth).json()["usage"]
        assert again["prompt_tokens_details"]["cached_tokens"] >= 8  # at least a block came from the cache
        assert again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]


def test_tokens_as_token_ids_by_default(flagged: TinyServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "hi", "max_tokens": 2, "logprobs": 1, "return_token_ids": True}
    choice = _post(flagged, COMPLETIONS, body, headers=auth).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    plain = _post(flagged, COMPLETIONS, body | {"return_tokens_as_token_ids": False}, headers=auth).json()
    assert not any(t.startswith("token_id:") for t in plain["choices"][0]["logprobs"]["tokens"])


def test_invocations_route_by_body_shape(server: TinyServer) -> None:
    chat = _post(server, "/invocations", {"messages": MSG, "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion"
    completion = _post(server, "/invocations", {"prompt": "hi", "max_tokens": 2}).json()
    assert completion["object"] == "text_completion"
    chunks = _sse(server, "/invocations", {"prompt": "hi", "max_tokens": 2})
    assert chunks[0]["object"] == "text_completion"
    _error(_post(server, "/invocations", {"messages": MSG, "max_tokens": "2"}), 400, "max_tokens")
    _error(_post(server, "/invocations", {"messages": MSG, "bogus": 1}), 400, "bogus")
    assert "messages" in _error(_post(server, "/invocations", {"input": "x"}), 400)["message"]
    for method in ("GET", "POST"):
        assert httpx.request(method, server.url + "/ping", timeout=30).json() == {"status": "ok"}


def test_lora_adapter_routes_say_adapters_are_not_served(server: TinyServer) -> None:
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        error = _error(_post(server, route, {"lora_name": "a", "lora_path": "/x"}), 400)
        assert error["code"] == "lora_not_supported" and "LoRA adapters are not supported" in error["message"]


def _samples(server: TinyServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:") and not s.labels.get("le"):
                key = s.name + "".join(f"{{{v}}}" for k, v in sorted(s.labels.items()) if k != "model_name")
                found[key] = s.value
    return found


def test_vllm_metric_series_count_as_vllms_tests_expect(flagged: TinyServer) -> None:
    """vLLM's test_metrics_counts: N completions of a P-token prompt with max_tokens M (each ends by length)."""
    n, m = 3, 5
    prompt = list(range(20, 31))
    before = _samples(flagged)
    for _ in range(n):
        body = {"prompt": prompt, "max_tokens": m, "ignore_eos": True}
        assert _post(flagged, COMPLETIONS, body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    after = _samples(flagged)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    p = len(prompt)
    expected = {
        "vllm:time_to_first_token_seconds_count": n,
        "vllm:inter_token_latency_seconds_count": n * (m - 1),
        "vllm:e2e_request_latency_seconds_count": n,
        "vllm:request_queue_time_seconds_count": n,
        "vllm:request_inference_time_seconds_count": n,
        "vllm:request_prefill_time_seconds_count": n,
        "vllm:request_decode_time_seconds_count": n,
        "vllm:request_prompt_tokens_sum": n * p,
        "vllm:request_prompt_tokens_count": n,
        "vllm:request_generation_tokens_sum": n * m,
        "vllm:request_params_n_count": n,
        "vllm:request_params_max_tokens_sum": n * m,
        "vllm:iteration_tokens_total_sum": n * (p + m),
        "vllm:iteration_tokens_total_count": n * m,
        "vllm:prompt_tokens_total": n * p,
        "vllm:generation_tokens_total": n * m,
        "vllm:request_success_total{length}": n,
    }
    assert {name: grew(name) for name in expected} == expected
    for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in after
    assert grew("vllm:prefix_cache_hits_total") > 0  # the same prompt three times
    assert after["vllm:num_requests_waiting_by_reason{capacity}"] == 0
    assert after["vllm:num_requests_waiting_by_reason{deferred}"] == 0
    assert (
        after[
            "vllm:cache_config_info{8}{auto}{True}{" + str(int(flagged.metric("conveyor_kv_cache_total_blocks"))) + "}"
        ]
        == 1
    )


def test_requests_the_shutdown_ends_get_a_503(server: TinyServer) -> None:
    """In flight when --shutdown-timeout runs out: a 503 with Retry-After, or (streamed) an error event with 503."""
    long = {"prompt": "count", "max_tokens": 480, "ignore_eos": True}
    results: dict[str, Any] = {}

    def whole() -> None:
        results["whole"] = _post(server, COMPLETIONS, long)

    def streamed() -> None:
        with httpx.stream("POST", server.url + COMPLETIONS, json=long | {"stream": True}, timeout=120) as r:
            results["stream"] = [line for line in r.iter_lines() if line.strip()]

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    while server.async_engine.num_active < 2:
        threading.Event().wait(0.01)

    async def drain() -> None:
        draining = DrainingServer(uvicorn.Config(app=None), server.state, shutdown_timeout=0.05)
        draining._loop = asyncio.get_running_loop()
        await draining._drain()

    asyncio.run(drain())
    server.state.draining = False  # the module's server goes on serving the other tests
    for t in threads:
        t.join(timeout=60)
    error = _error(results["whole"], 503)
    assert error["code"] == "shutdown" and "shutdown-timeout" in error["message"]
    assert results["whole"].headers["Retry-After"]
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]"
    event = json.loads(lines[-2][len("data: ") :])["error"]
    assert event["code"] == "shutdown" and event["type"] == "service_unavailable_error"


def test_dtype_half_and_float_are_vllms_names() -> None:
    from conveyor.cli import build_parser, engine_config_from

    for name, meant in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")):
        assert EngineConfig(dtype=name).dtype == meant
        assert engine_config_from(build_parser().parse_args(["serve", "--dtype", name])).dtype == meant
