"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), validated by pydantic."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, StrictInt, field_validator, model_validator

from conveyor.params import SamplingParams
from conveyor.server.strict_body import StrictBody
from conveyor.server.vllm_extras import VllmChatFields, VllmFields


def bounds(name: str) -> dict[str, Any]:
    """The numeric bounds SamplingParams puts on its field `name` (ge / gt / le / lt), so the server
    refuses exactly what the engine would: one source for every value range. (mypy's pydantic support cannot
    see through `Field(**bounds(...))`, hence the `type: ignore[misc]` at each use.)"""
    found: dict[str, Any] = {}
    for constraint in SamplingParams.model_fields[name].metadata:
        for key in ("ge", "gt", "le", "lt"):
            value = getattr(constraint, key, None)
            if value is not None:
                found[key] = value
    if not found:
        raise ValueError(f"SamplingParams.{name} has no numeric bounds to derive")
    return found


MAX_N = 16
"""The server's own, stricter cap on samples per HTTP request (SamplingParams allows more offline)."""
MAX_STOP = 16


class StreamOptions(StrictBody):
    include_usage: bool = False
    include_obfuscation: bool = False
    """OpenAI pads chunks against side channels when true; accepted and ignored (no padding here)."""
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, usage (this choice's tokens so far) in every chunk too (server/usage.py)."""


class _SamplingFields(VllmFields):
    """Fields shared by completions and chat completions (strict types, valid Unicode: StrictBody)."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, **bounds("temperature"))  # type: ignore[misc]
    top_p: float | None = Field(default=None, **bounds("top_p"))  # type: ignore[misc]
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, **bounds("seed"))  # type: ignore[misc]  # int64, as OpenAI and vLLM
    presence_penalty: float = Field(default=0.0, **bounds("presence_penalty"))  # type: ignore[misc]
    frequency_penalty: float = Field(default=0.0, **bounds("frequency_penalty"))  # type: ignore[misc]
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    # OpenAI fields that change nothing here: accepted so that clients which always send them work
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extra sampling fields
    top_k: int = Field(default=0, **bounds("top_k"))  # type: ignore[misc]
    min_p: float = Field(default=0.0, **bounds("min_p"))  # type: ignore[misc]
    repetition_penalty: float = Field(default=1.0, **bounds("repetition_penalty"))  # type: ignore[misc]
    min_tokens: int = Field(default=0, **bounds("min_tokens"))  # type: ignore[misc]
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=256)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output: OpenAI's response_format, vLLM's structured_outputs and older guided_* fields
    # (read and checked in server/request_constraints.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=16, ge=0)
    """0 only with echo: score the prompt (its logprobs) without generating."""
    logprobs: int | None = Field(default=None, **bounds("logprobs"))  # type: ignore[misc]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


class ChatMessage(StrictBody):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1, max_length=64)
    """OpenAI's system, user, assistant, developer and tool, or any other role the chat template takes (as vLLM
    passes custom roles on; a template that refuses one makes the request a 400)."""
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            for part in value:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return value

    @model_validator(mode="after")
    def _tool_turns(self) -> ChatMessage:
        extra = self.model_extra or {}
        if extra.get("function_call"):
            raise ValueError("function_call (OpenAI's deprecated form) is not supported; send tool_calls")
        calls = extra.get("tool_calls")
        if calls is not None:
            if self.role != "assistant":
                raise ValueError("only assistant messages carry tool_calls")
            if not isinstance(calls, list) or not all(
                isinstance(c, dict)
                and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                for c in calls
            ):
                raise ValueError(
                    "tool_calls must be a list of {'id', 'type': 'function', 'function': {'name', 'arguments'}}"
                )
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message for the chat template: role, text, and tool_calls / tool_call_id / name when present."""
        extra = self.model_extra or {}
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("tool_calls", "tool_call_id"):
            if extra.get(key) is not None:
                message[key] = extra[key]
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part["text"] for part in self.content)  # as vLLM joins text parts
        return self.content or ""


class ChatCompletionRequest(_SamplingFields, VllmChatFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, **bounds("logprobs"))  # type: ignore[misc]
    add_generation_prompt: bool = True
    # tool calling (checked in conveyor/tools/choice.py)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
