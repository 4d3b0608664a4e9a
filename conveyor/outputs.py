"""What users receive: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop' (EOS or a stop token), 'length' (max_tokens or max_model_len), 'abort', 'error', or None while running."""
    stop_reason: int | str | None = None
    """The stop token id that ended generation, when one did (None for EOS and length)."""


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
