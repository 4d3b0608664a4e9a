"""tools + tool_choice -> a ToolPlan: what the chat template is shown, which constraint the output gets,
and how the reply is read back into tool calls.

    "none"       tools are not offered; the reply is plain content
    "auto"       tools are offered; calls are found in the reply by the model family's parser
    "required"   the reply is constrained to a JSON array of calls [{"name", "arguments"}] (at least one;
                 exactly one when parallel_tool_calls is false), each name one of the tools' and its
                 arguments following that tool's parameter schema (vLLM's approach), so even a small
                 model emits valid calls; a reply cut short (max_tokens) keeps the calls it completed and
                 no content, as vLLM's does
    named        {"type": "function", "function": {"name": N}}: the reply is constrained to N's arguments
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conveyor.errors import InvalidRequestError
from conveyor.tools.parsers import ToolCall, ToolParser, call_from_json


class ToolRequestError(InvalidRequestError):
    """A tools / tool_choice problem; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str = "function"
    function: FunctionDefinition


@dataclass(frozen=True)
class ToolPlan:
    mode: str
    """'none', 'auto', 'required' or 'named'."""
    tools: list[dict[str, Any]]
    """The tools as given (OpenAI shape), shown to the chat template unless mode is 'none'."""
    constraint: dict[str, Any] | None = None
    """A StructuredOutputs value ({"json": schema}) for 'required' and 'named'."""
    named: str | None = None

    @property
    def offers_tools(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def read_reply(self, text: str, parser: ToolParser) -> tuple[str | None, list[ToolCall]]:
        """A finished reply -> (content, tool calls)."""
        if self.mode == "none":
            return text, []
        if self.mode == "auto":
            return parser.parse(text)
        try:
            value = json.loads(text)
        except ValueError:
            return text, []  # cut short (finish_reason "length"): no call is claimed
        if self.mode == "named":
            call = call_from_json({"name": self.named, "arguments": value})
            return (None, [call]) if call is not None else (text, [])
        calls = [call_from_json(item) for item in value] if isinstance(value, list) else []
        if not calls or any(c is None for c in calls):
            return text, []
        return None, [c for c in calls if c is not None]

    def read_cut_reply(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """A reply cut short (finish_reason "length") -> ("", the calls it completed) for 'required', whose reply is
        an array of calls (a small model may repeat a call until max_tokens); None for other modes (the text stays
        content)."""
        if self.mode != "required":
            return None
        return "", complete_calls(text)


def complete_calls(text: str) -> list[ToolCall]:
    """The calls of a JSON array of calls, up to the last complete one when the array was cut short."""
    decoder = json.JSONDecoder()
    at = _skip_space(text, 0)
    if not text.startswith("[", at):
        return []
    at = _skip_space(text, at + 1)
    calls: list[ToolCall] = []
    while at < len(text):
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break  # the call that was cut short
        call = call_from_json(item)
        if call is None:
            break
        calls.append(call)
        at = _skip_space(text, at)
        if not text.startswith(",", at):
            break
        at = _skip_space(text, at + 1)
    return calls


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None = None,
) -> ToolPlan:
    """Validate tools and tool_choice (ToolRequestError naming the field) and decide the plan."""
    definitions: list[ToolDefinition] = []
    for i, tool in enumerate(tools or []):
        try:
            definitions.append(ToolDefinition.model_validate(tool))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ToolRequestError(
                f"tools[{i}] is not a function tool ({where}: {err['msg']}); expected "
                f"{{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
                "tools",
            ) from None
        if definitions[-1].type != "function":
            raise ToolRequestError(f"tools[{i}].type={definitions[-1].type!r}: only 'function' tools exist", "tools")
    names = [d.function.name for d in definitions]
    if len(set(names)) != len(names):
        raise ToolRequestError(f"tool names must be unique; got {names}", "tools")
    choice = tool_choice if tool_choice is not None else ("auto" if definitions else "none")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolRequestError(
                "tool_choice as an object must be {'type': 'function', 'function': {'name': ...}}", "tool_choice"
            )
        if name not in names:
            raise ToolRequestError(
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({', '.join(names) or 'none given'})",
                "tool_choice",
            )
        function = definitions[names.index(name)].function
        return ToolPlan("named", list(tools or []), {"json": _parameters(function)}, name)
    if choice not in ("none", "auto", "required"):
        raise ToolRequestError(
            f"tool_choice={choice!r} is not one of 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}",
            "tool_choice",
        )
    if choice != "none" and not definitions:
        raise ToolRequestError(f"tool_choice={choice!r} needs tools, and none were given", "tool_choice")
    if choice != "required":
        return ToolPlan(choice, list(tools or []))
    call_schemas = [
        {
            "type": "object",
            "properties": {"name": {"enum": [d.function.name]}, "arguments": _parameters(d.function)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for d in definitions
    ]
    array: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas},
    }
    if parallel_tool_calls is False:
        array["maxItems"] = 1
    return ToolPlan("required", list(tools or []), {"json": array})
