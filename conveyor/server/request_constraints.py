"""Structured output and tools in a request -> one constraint for SamplingParams (or a 400 naming the field).

Sources, at most one of them per request: OpenAI's `response_format` ({"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's `structured_outputs`
and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and a tool_choice
of "required" or a named function (which constrain the reply to tool calls).
"""

from __future__ import annotations

from typing import Any

from conveyor.server.error_responses import APIError
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.tools.choice import ToolPlan, ToolRequestError, plan_tools

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise APIError(
                400, "response_format.json_schema must be an object {'name': ..., 'schema': {...}}", "response_format"
            )
        return {"json": spec.get("schema", {})}
    raise APIError(
        400, f"response_format.type={kind!r} is not one of 'text', 'json_object', 'json_schema'", "response_format"
    )


def request_constraint(body: CompletionRequest | ChatCompletionRequest) -> tuple[dict[str, Any] | None, str | None]:
    """(the StructuredOutputs value, the field it came from); APIError when several are given."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.response_format is not None:
        value = _from_response_format(body.response_format)
        if value is not None:
            found.append(("response_format", value))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", body.structured_outputs))
    for name, kind in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, {kind: value}))
    if len(found) > 1:
        raise APIError(
            400, f"{found[1][0]} cannot be combined with {found[0][0]}: give one output constraint", found[1][0]
        )
    return (found[0][1], found[0][0]) if found else (None, None)


def chat_constraint(body: ChatCompletionRequest) -> tuple[ToolPlan, dict[str, Any] | None, str | None]:
    """The tool plan and the one constraint of a chat request (tools' or the response format's)."""
    try:
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolRequestError as exc:
        raise APIError(400, str(exc), exc.param) from None
    constraint, source = request_constraint(body)
    if constraint is not None and plan.mode in ("required", "named"):
        raise APIError(
            400,
            f"{source} cannot be combined with tool_choice={body.tool_choice!r}: that tool "
            f"choice already constrains the reply to tool calls",
            source,
        )
    if constraint is not None and plan.mode == "auto":
        raise APIError(
            400,
            f"{source} with tools and tool_choice 'auto' cannot both be honoured (a constrained "
            f"reply cannot be a tool call); use tool_choice 'none' to get the formatted reply, or "
            f"'required' for tool calls",
            source,
        )
    if plan.constraint is not None:
        return plan, plan.constraint, "tools" if plan.mode == "required" else "tool_choice"
    return plan, constraint, source
