"""What users receive: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.plan import TokenLogprobs

NON_FINITE_LOGITS = "non_finite_logits"
"""RequestOutput.error_code of a request ended because the model's logits for it held NaN or infinity."""
SHUTDOWN = "shutdown"
"""RequestOutput.error_code of a request the server ended because it shut down before the request finished."""


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: one token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class PositionLogprobs(TokenLogprobs, Mapping[int, Logprob]):
    """The logprobs of one position in two shapes at once:
    - Conveyor's: `.token_id`, `.logprob`, `.rank`, `.top` (the top-N (id, logprob), most likely first);
    - vLLM's `dict[int, Logprob]`: the chosen token first, then the top-N not already listed, so that
      `out.logprobs[i][token_id].logprob`, `.items()`, `len()` and `in` work as in vLLM (logprobs=0 holds
      the chosen token alone)."""

    decode: Callable[[int], str] | None = field(default=None, repr=False, compare=False)
    """Token id -> its text (decoded_token); None where the model has no tokenizer."""

    @classmethod
    def of(cls, lp: TokenLogprobs, decode: Callable[[int], str] | None) -> PositionLogprobs:
        return cls(lp.token_id, lp.logprob, lp.rank, lp.top, decode)

    def __getitem__(self, token_id: int) -> Logprob:
        if token_id == self.token_id:
            found: tuple[float, int] | None = (self.logprob, self.rank)
        else:
            found = next(((logprob, j + 1) for j, (other, logprob) in enumerate(self.top) if other == token_id), None)
        if found is None:
            raise KeyError(token_id)
        return Logprob(found[0], found[1], self.decode(token_id) if self.decode is not None else None)

    def __iter__(self) -> Iterator[int]:
        yield self.token_id
        yield from (other for other, _ in self.top if other != self.token_id)

    def __len__(self) -> int:
        return 1 + sum(other != self.token_id for other, _ in self.top)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop' (EOS or a stop token), 'length' (max_tokens or max_model_len), 'abort', 'error', or None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended generation (None for EOS and length)."""
    logprobs: list[PositionLogprobs] | None = None
    """Per generated token, when SamplingParams.logprobs was set: raw-model logprobs, each both Conveyor's
    TokenLogprobs and vLLM's {token_id: Logprob} (see PositionLogprobs)."""
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
    error_code: str | None = None
    """Why the request failed, for programs (never parse `error`, which is for people): "timeout" (its
    deadline passed), "grammar" (structured output could not continue), "non_finite_logits" (the model's logits
    held NaN or infinity: NON_FINITE_LOGITS), "shutdown" (the server stopped before it finished: SHUTDOWN),
    "engine_error" (anything else); None when it did not fail."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Timings in seconds from the engine's arrival of the request: "ttft_s" (to its first token) and "queued_s"
    (waiting in the queue, until first scheduled), once they happened."""
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """When SamplingParams.prompt_logprobs was set: None for the first prompt token, then the
    logprob of each prompt token given the ones before it (vLLM's PromptLogprobs shape too)."""
