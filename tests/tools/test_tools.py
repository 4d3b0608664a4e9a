"""Tool calling: the model families' formats, tool_choice plans, and LLM.chat(tools=...)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from conveyor import InvalidRequestError, SamplingParams
from conveyor.tools import parser_for, plan_tools, render_conversation
from conveyor.tools.choice import ToolRequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    },
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_each_format_reads_back_what_it_writes(name: str) -> None:
    parser = parser_for(name, None)
    text = parser.render(CALLS)
    content, calls = parser.parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in CALLS
    ]
    assert parser.parse("The weather is fine.") == ("The weather is fine.", [])


def test_formats_found_in_real_outputs() -> None:
    hermes = parser_for("hermes", None)
    content, calls = hermes.parse('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert content == "Let me check." and calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 1}
    assert hermes.parse("<tool_call>{not json}</tool_call>")[1] == []  # malformed: stays content
    llama = parser_for("llama3_json", None)
    calls = llama.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')[1]
    assert [c.name for c in calls] == ["f", "g"]
    mistral = parser_for("mistral", None)
    calls = mistral.parse('[TOOL_CALLS] [{"name": "f", "arguments": {"x": "y"}}]')[1]
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": "y"}
    assert parser_for("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for("auto", "<|python_tag|>").name == "llama3_json"
    assert parser_for("auto", "<|im_start|>").name == "hermes"


def test_tool_choice_plans_and_refusals() -> None:
    assert plan_tools(None, None).mode == "none"
    assert plan_tools([WEATHER], None).mode == "auto"
    required = plan_tools([WEATHER], "required", parallel_tool_calls=False)
    schema = required.constraint["json"]
    good = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good * 2, schema)  # parallel_tool_calls=False: one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "arguments": {}}], schema)
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named.constraint == {"json": WEATHER["function"]["parameters"]}
    content, calls = named.read_reply('{"city": "Oslo", "unit": "celsius"}', parser_for("hermes", None))
    assert content is None and calls[0].name == "get_weather"
    for tools, choice, param in [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (None, "required", "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([{"type": "function", "function": {}}], None, "tools"),
        ([WEATHER, WEATHER], None, "tools"),
    ]:
        with pytest.raises(ToolRequestError) as info:
            plan_tools(tools, choice)
        assert info.value.param == param


def test_template_without_tool_support_gets_tools_and_history_as_text() -> None:
    parser = parser_for("hermes", None)
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    rendered, extra = render_conversation(messages, [WEATHER], "{{ message['content'] }}", parser)
    assert extra == {} and rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert "<tool_call>" in rendered[2]["content"] and "Paris" in rendered[2]["content"]
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
    native, extra = render_conversation(messages, [WEATHER], "{% for t in tools %}{% endfor %}", parser)
    assert extra == {"tools": [WEATHER]} and native[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris",
        "unit": "celsius",
    }


def test_llm_chat_with_required_tools_gives_valid_calls(default_llm: Any) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = default_llm.chat(
        ask, SamplingParams(max_tokens=60, temperature=0), use_tqdm=False, tools=[WEATHER], tool_choice="required"
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.tool_calls
    for call in out.tool_calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        default_llm.chat(
            ask, SamplingParams(structured_outputs={"regex": "a"}), tools=[WEATHER], tool_choice="required"
        )


def test_streamed_content_stops_where_a_call_could_begin() -> None:
    from conveyor.server.tool_stream import _safe_end

    assert _safe_end("Hello there", "<tool_call>") == len("Hello there")
    assert _safe_end("Hello <tool", "<tool_call>") == len("Hello ")  # could be the start of a call: held
    assert _safe_end("Hi <tool_call>{", "<tool_call>") == len("Hi ")
    assert _safe_end("a < b", "<tool_call>") == len("a < b")
