"""vLLM's extensions to the OpenAI API: the request fields Conveyor honours (mixed into protocol.py's
models), the ones it refuses by name, and the response fields they add.

Honoured: prompt_logprobs, return_token_ids (prompt_token_ids and token_ids in responses),
return_tokens_as_token_ids, truncate_prompt_tokens and truncation_side (prompt_truncation.py),
stream_options.continuous_usage_stats (protocol.py, usage.py), and for chat: echo, continue_final_message,
add_generation_prompt, chat_template_kwargs (template_kwargs.py). Refused with a 400 that says so: beam search
(use_beam_search, length_penalty other than 1), prompt embeddings, and -1 ("the whole vocabulary") as a
logprobs count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from conveyor.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from conveyor.params import MAX_LOGPROBS
from conveyor.server.error_responses import APIError
from conveyor.server.logprobs import TokenBytes
from conveyor.server.strict_body import StrictBody
from conveyor.server.usage import UsagePolicy, usage_policy

if TYPE_CHECKING:
    from conveyor.server.state import ServerOptions


class VllmFields(StrictBody):
    """vLLM's fields of both /v1/completions and /v1/chat/completions."""

    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Logprobs of each prompt token (and its top-N alternatives), in vLLM's shape; not when streaming."""
    return_token_ids: bool = False
    """Add prompt_token_ids and each choice's generated token_ids to the response."""
    return_tokens_as_token_ids: bool | None = None
    """Name tokens in logprobs as 'token_id:<id>' (for tokens that are not valid UTF-8 on their own); None: the
    server's --return-tokens-as-token-ids."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """Keep only this many prompt tokens (the last ones, unless truncation_side is 'right'); -1: as many as the
    context leaves after max_tokens."""
    truncation_side: Literal["left", "right"] | None = None
    """Which end truncate_prompt_tokens cuts: 'left' (the default: keep the last tokens) or 'right'."""
    use_beam_search: bool = False
    length_penalty: float = 1.0
    prompt_embeds: Any | None = None

    @field_validator("logprobs", "top_logprobs", "prompt_logprobs", mode="before", check_fields=False)
    @classmethod
    def _no_whole_vocabulary(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value == -1:
            raise ValueError(
                f"-1 (the logprobs of the whole vocabulary) is not supported; ask for 0 to "
                f"{MAX_LOGPROBS} alternatives per token"
            )
        return value

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value: bool) -> bool:
        if value:
            raise ValueError("beam search is not supported; sample n completions (with a seed) instead")
        return value

    @field_validator("length_penalty")
    @classmethod
    def _no_length_penalty(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError("length_penalty applies to beam search, which is not supported; leave it at 1")
        return value

    @field_validator("prompt_embeds")
    @classmethod
    def _no_prompt_embeds(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("prompt embeddings are not supported; send the prompt as text or token ids")
        return value


class VllmChatFields(StrictBody):
    """vLLM's fields of /v1/chat/completions only (add_generation_prompt is in protocol.py)."""

    echo: bool = False
    """Start the reply with the last message's content when that message has the reply's role."""
    continue_final_message: bool = False
    """Render the last message open-ended, so that the reply continues it (needs add_generation_prompt off)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template (e.g. Qwen3's enable_thinking); checked in template_kwargs.py."""


@dataclass(frozen=True)
class ResponseExtras:
    """What vLLM's fields ask of a response, decided once when the request is prepared."""

    return_token_ids: bool = False
    tokens_as_ids: bool = False
    prompt_logprobs: int | None = None
    """How many alternatives per prompt position to report (the engine may compute more, for echo)."""
    usage: UsagePolicy = field(default_factory=UsagePolicy)
    """Which chunks of a stream carry usage, and what a full usage holds (usage.py)."""
    role: str = "assistant"
    """Chat: the reply's role: assistant, or with add_generation_prompt off the last message's role (as vLLM)."""
    chat_echo: str = ""
    """Chat with echo: the text the reply starts with."""


def extras_of(body: Any, server: ServerOptions, role: str = "assistant", chat_echo: str = "") -> ResponseExtras:
    """What a request's fields and the server's flags ask of its response."""
    as_ids = body.return_tokens_as_token_ids
    return ResponseExtras(
        return_token_ids=body.return_token_ids,
        tokens_as_ids=server.return_tokens_as_token_ids if as_ids is None else as_ids,
        prompt_logprobs=body.prompt_logprobs,
        usage=usage_policy(body.stream_options, server.force_include_usage, server.prompt_tokens_details),
        role=role,
        chat_echo=chat_echo,
    )


class TokenIdNames(TokenBytes):
    """TokenBytes whose display text is 'token_id:<id>' (return_tokens_as_token_ids); the bytes stay real."""

    def __init__(self, inner: TokenBytes | None) -> None:  # super().__init__ not called: wraps inner
        self.inner = inner

    def of(self, token_id: int) -> tuple[bytes, str]:
        raw = self.inner.of(token_id)[0] if self.inner is not None else str(token_id).encode()
        return raw, f"token_id:{token_id}"


def prompt_logprobs_json(positions: Sequence[PositionLogprobs | None] | None, top: int) -> list[Any] | None:
    """vLLM's prompt_logprobs: None for the first position, then {"<id>": {logprob, rank, decoded_token}} for
    the prompt token and its `top` most likely alternatives."""
    if positions is None:
        return None
    result: list[Any] = []
    for position in positions:
        if position is None:
            result.append(None)
            continue
        ids = [position.token_id] + [i for i, _ in position.top[:top] if i != position.token_id]
        result.append({str(i): vars(position[i]) for i in ids})
    return result


def choice_token_ids(
    extras: ResponseExtras, c: CompletionOutput, start: int = 0, nulls: bool = False
) -> dict[str, Any]:
    """A choice's generated token ids from `start` on, when return_token_ids asked for them; else nothing, or
    with `nulls` (a whole response, whose fields vLLM always sends) `token_ids: null`."""
    if extras.return_token_ids:
        return {"token_ids": list(c.token_ids[start:])}
    return {"token_ids": None} if nulls else {}


def prompt_fields(extras: ResponseExtras, out: RequestOutput) -> dict[str, Any]:
    """vLLM's prompt_token_ids / prompt_logprobs of a whole response (chat) or of its choices (completions): null
    unless asked for, as vLLM always sends them."""
    ids = list(out.prompt_token_ids) if extras.return_token_ids else None
    logprobs = None
    if extras.prompt_logprobs is not None:
        logprobs = prompt_logprobs_json(out.prompt_logprobs, extras.prompt_logprobs)
    return {"prompt_token_ids": ids, "prompt_logprobs": logprobs}


def generation_prompt(body: Any) -> bool:
    """Whether to render the assistant's turn opening: add_generation_prompt, off when continue_final_message
    is on (unless both were asked for explicitly, which is refused)."""
    if body.continue_final_message and body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise APIError(
            400,
            "continue_final_message continues the last message, so it cannot be combined with "
            "add_generation_prompt=true (which opens a new one); set one of them to false",
            "continue_final_message",
        )
    return bool(body.add_generation_prompt and not body.continue_final_message)


def no_streamed_prompt_logprobs(body: Any, completions: bool) -> None:
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(
            400,
            "prompt_logprobs is not available when streaming (as in vLLM); ask without "
            "stream" + (", or use echo with logprobs" if completions else ""),
            "prompt_logprobs",
        )
