"""Conversations with tools -> the chat template's input.

A template that knows tools (it mentions `tools` / `tool_calls`) gets them natively, with each
call's arguments as an object, as Hugging Face templates expect. A template that does not (the
embedded SmolLM2's) gets the tools described in the system message and past calls and results
written in the parser's own format, so the conversation still reaches the model whole.
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.tools.parsers import ToolParser

_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are given "
    "within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\nFor each function call, return a "
    "JSON object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _native_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {**call, "function": function}


def render_conversation(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, chat_template: str | None, parser: ToolParser
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages for apply_chat_template, extra keyword arguments for it)."""
    template = chat_template or ""
    native = "tool_calls" in template or "tools" in template
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls") or []
        if native:
            if calls:
                m["tool_calls"] = [_native_call(c) for c in calls]
            m["content"] = m.get("content") or ""
        elif m["role"] == "assistant" and calls:
            text = m.get("content") or ""
            m = {"role": "assistant", "content": (text + "\n" if text else "") + parser.render(calls)}
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        else:
            m = {"role": m["role"], "content": m.get("content") or ""}
        out.append(m)
    if not tools:
        return out, {}
    if native:
        return out, {"tools": tools}
    described = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + described}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out, {}
