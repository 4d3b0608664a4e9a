"""Structured output and tool calling through a real server and the real `openai` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from helpers.server_process import ServerProcess, running_server

MODEL = "SmolLM2-135M-Instruct"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 10}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--max-model-len", "1024") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=100_000_000)


def test_parse_with_a_pydantic_model_returns_the_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_schema_on_completions(server: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    r = server.http.post(
        server.url + "/v1/completions",
        timeout=600,
        json={
            "prompt": "2 + 2 =",
            "max_tokens": 30,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), schema)
    r = server.http.post(
        server.url + "/v1/chat/completions",
        timeout=600,
        json={
            "messages": ASK,
            "max_tokens": 60,
            "temperature": 0.7,
            "seed": 3,
            "n": 2,
            "response_format": {"type": "json_object"},
        },
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
    r = server.http.post(
        server.url + "/v1/completions",
        timeout=600,
        json={"prompt": "Pick a colour:", "max_tokens": 10, "guided_choice": ["red", "green"], "temperature": 0},
    )
    assert r.json()["choices"][0]["text"] in ("red", "green")


def _check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_gives_valid_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    single = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0.8,
        seed=5,
    )
    assert len(single.choices[0].message.tool_calls) == 1


def test_named_tool_choice_streamed_and_reassembled(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    full = client.chat.completions.create(**kwargs)
    _check_calls(full.choices[0].message.tool_calls, {"get_weather"})
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": ""})
                entry["id"] += delta.id or ""
                entry["name"] += delta.function.name or "" if delta.function else ""
                entry["arguments"] += delta.function.arguments or "" if delta.function else ""
    assert [r for r in reasons if r] == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls
    ]
    with client.chat.completions.stream(**{**kwargs, "tool_choice": "required"}) as stream:
        final = stream.get_final_completion()
    _check_calls(final.choices[0].message.tool_calls, {"get_weather", "get_time"})


def test_conversation_with_a_tool_result_continues(client: openai.OpenAI) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=30, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    alone = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    assert reply.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result reached the model
