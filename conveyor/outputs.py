"""What users receive: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.core.plan import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop' (EOS or a stop token), 'length' (max_tokens or max_model_len), 'abort', 'error', or None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended generation (None for EOS and length)."""
    logprobs: list[TokenLogprobs] | None = None
    """Per generated token, when SamplingParams.logprobs was set: raw-model logprobs."""
    tool_calls: list[Any] | None = None
    """`LLM.chat(..., tools=...)`: the conveyor.tools.ToolCall objects found in the reply (None when none)."""

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """When SamplingParams.prompt_logprobs was set: None for the first prompt token, then the
    logprob of each prompt token given the ones before it."""
