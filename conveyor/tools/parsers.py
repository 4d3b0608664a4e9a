"""Tool-call formats of the common model families: find the calls in a reply, or write calls as text.

hermes       Hermes / Qwen:   <tool_call>{"name": ..., "arguments": {...}}</tool_call> (one block per call)
llama3_json  Llama 3.x:       [<|python_tag|>]{"name": ..., "parameters": {...}} (several joined by ';')
mistral      Mistral:         [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import ConfigError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI's shape)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from_json(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """{"name": str, "arguments" (or "parameters"): object or JSON text} -> ToolCall; None if not that shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    name = "base"
    start_marker = ""
    """Text that begins a tool call in this format; streamed content is held back from it on."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content left outside the calls or None, calls found); no calls -> (text, [])."""
        raise NotImplementedError

    def render(self, calls: list[dict[str, Any]]) -> str:
        """Assistant tool_calls (OpenAI shape) as this family writes them, for templates without tool support."""
        raise NotImplementedError


def _arguments(call: dict[str, Any]) -> Any:
    args = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


class HermesParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start_marker not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                call = call_from_json(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: the text stays content, nothing is guessed
            calls.append(call)
        content = text[: text.index(self.start_marker)].strip()
        return content or None, calls

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            "<tool_call>\n"
            + json.dumps({"name": c.get("function", {}).get("name"), "arguments": _arguments(c)}, ensure_ascii=False)
            + "\n</tool_call>"
            for c in calls
        )


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start_marker = "{"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except ValueError:
                return text, []
            call = call_from_json(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \n;":
                position += 1
        return None, calls

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": c.get("function", {}).get("name"), "parameters": _arguments(c)}, ensure_ascii=False)
            for c in calls
        )


class MistralParser(ToolParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start_marker not in text:
            return text, []
        content, _, rest = text.partition(self.start_marker)
        try:
            items = json.loads(rest.strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [call_from_json(item) for item in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return content.strip() or None, [c for c in calls if c is not None]

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "[TOOL_CALLS]" + json.dumps(
            [{"name": c.get("function", {}).get("name"), "arguments": _arguments(c)} for c in calls], ensure_ascii=False
        )


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def parser_for(name: str, chat_template: str | None) -> ToolParser:
    """`name` ('auto' picks from the chat template's markers; Hermes when it shows none)."""
    if name == "auto":
        template = chat_template or ""
        if "[TOOL_CALLS]" in template:
            name = "mistral"
        elif "<|python_tag|>" in template or "ipython" in template:
            name = "llama3_json"
        else:
            name = "hermes"
    if name not in PARSERS:
        raise ConfigError(f"tool_call_parser={name!r} is not known; choose one of auto, {', '.join(PARSERS)}")
    return PARSERS[name]()
