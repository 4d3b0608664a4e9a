"""Request: token ids and the counters that drive scheduling (no phases, only counters)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    `token_ids` holds prompt + committed output. The scheduler advances
    `num_computed_tokens` when it plans a step (tokens whose KV will exist once the step
    ran); `num_inflight_tokens` counts tokens that a planned step will sample but that
    are not committed yet. Prefill, chunked prefill, decode and recompute after
    preemption are all "compute tokens[num_computed:num_tokens + num_inflight]".
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_index: int
    max_model_len: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    """time.perf_counter() when it was first scheduled (it stopped waiting in the queue); None before."""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    eos_token_ids: tuple[int, ...] = ()
    multi_step: bool = False
    """Its decode steps may run several per plan (Scheduler: a plain greedy request whose output is returned
    only at its end); set by the engine at admission."""
    fork_parent: str | None = None
    """For sample i > 0 of an n > 1 request: the id of sample 0, whose prompt KV blocks this
    one shares (forked when sample 0 first samples); None otherwise."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens + self.num_inflight_tokens - self.num_computed_tokens

    @property
    def reached_length_limit(self) -> bool:
        """Committed plus in-flight tokens already reach max_tokens or max_model_len."""
        pending = self.num_inflight_tokens
        max_tokens = self.params.max_tokens
        return (
            max_tokens is not None and self.num_output_tokens + pending >= max_tokens
        ) or self.num_tokens + pending >= self.max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
