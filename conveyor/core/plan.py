"""StepPlan / StepResult: the one plain-data contract between scheduler and model runner."""

from __future__ import annotations

from dataclasses import dataclass

PLACEHOLDER_TOKEN = -1
"""Input id of a token that the previous, still in-flight step is sampling; the runner
fills it on the device from that step's output."""


@dataclass(frozen=True)
class SamplingSpec:
    """What the sampler needs of one row (plain numbers, no objects from above)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    output_index: int
    """Index of the token being sampled among the request's outputs: the random stream's
    counter, so the draw depends on (seed, index) only, never on the batch around it."""


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    input_token_ids: list[int]
    """Tokens whose KV this step computes; PLACEHOLDER_TOKEN where not yet known."""
    start_position: int
    """Position of input_token_ids[0] (= num_computed_tokens before this step)."""
    block_table: list[int]
    sampling: SamplingSpec | None
    """None for a prefill chunk that does not reach the end of the known tokens."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def context_len(self) -> int:
        return self.start_position + len(self.input_token_ids)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    seqs: list[ScheduledSeq]
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def sampling_seqs(self) -> list[ScheduledSeq]:
        return [s for s in self.seqs if s.sampling is not None]


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled_token_ids: list[int]
    """One id per entry of plan.sampling_seqs, in that order."""
