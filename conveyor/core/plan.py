"""StepPlan / StepResult: the one plain-data contract between scheduler and model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEHOLDER_TOKEN = -1
"""Id of a token that the previous, still in-flight step is sampling; the runner fills it
on the device from that step's output (in inputs and in penalty histories alike)."""
NONFINITE_TOKEN = -2
"""Id the runner reports for a sampled row whose logits were not finite (NaN or +inf): no token could be drawn,
and the commit ends that request with an error instead of appending a token."""


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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    suppress_token_ids: tuple[int, ...] = ()
    """Tokens masked out (EOS and stop tokens while fewer than min_tokens were generated)."""
    history_tail: tuple[int, ...] | None = None
    """Only when a penalty is on: the request's known ids (prompt + committed outputs) from index
    `history_start` on, i.e. those the runner has not been sent yet (all of them for a row new to it)."""
    history_start: int = 0
    """How many known ids of this request the runner already holds (0: a row new to the runner)."""
    num_history_placeholders: int = 0
    """Outputs still in flight after the known ids: PLACEHOLDER_TOKEN in the penalty history this step."""
    num_prompt_tokens: int = 0
    logprobs: int | None = None
    constrained: bool = False
    """A grammar restricts this row's token (structured output): its mask comes with the step."""

    @property
    def has_penalties(self) -> bool:
        return self.history_tail is not None


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    input_token_ids: list[int]
    """Tokens whose KV this step computes; PLACEHOLDER_TOKEN where not yet known. Empty for
    a forked sample that draws from its parent's logits (`sample_from`)."""
    start_position: int
    """Position of input_token_ids[0] (= num_computed_tokens before this step)."""
    block_table_tail: list[int]
    """The request's block table from index `block_table_start` on: the entries the runner does not hold
    yet (new blocks, a copy-on-write block, entries a sliding window freed); the whole table for a
    request new to the runner. See core/persistent_batch.py."""
    block_table_start: int
    """Leading entries of the runner's copy of the table that are still right (0: replace it whole)."""
    sampling: SamplingSpec | None
    """None for a prefill chunk that does not reach the end of the known tokens."""
    sample_from: str | None = None
    """For a sample forked from another sequence: that sequence's id (same logits row)."""
    prompt_logprob_targets: list[int] | None = None
    """For prompt_logprobs: the next prompt token of each input position (-1 past the prompt)."""
    num_prompt_logprobs: int = 0
    arrival_index: int = -1
    """Identifies the request object, so a result never lands on a later request reusing the id."""

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
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) blocks to copy before the forward: copy-on-write of shared blocks."""
    dropped_ids: list[str] = field(default_factory=list)
    """Requests whose per-request state the runner forgets before this step: finished, aborted or
    preempted since the previous plan (a preempted one comes back later in full)."""
    num_steps: int = 1
    """Decode steps run back to back for this plan (> 1 only for a plan of plain greedy decodes, one token each,
    every one sampled): step j + 1 takes step j's tokens as its inputs, at the next positions; the scheduler has
    allocated the blocks for all of them."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV the plan computes over all its steps (num_tokens, plus one per sequence per later step)."""
        return self.num_tokens + (self.num_steps - 1) * len(self.seqs)

    @property
    def num_sampled(self) -> int:
        """Tokens the plan samples over all its steps."""
        return len(self.sampling_seqs) * self.num_steps

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def sampling_seqs(self) -> list[ScheduledSeq]:
        return [s for s in self.seqs if s.sampling is not None]


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (raw model distribution) around one token."""

    token_id: int
    logprob: float
    rank: int
    """1 = the most likely token."""
    top: list[tuple[int, float]]
    """The top-N (token id, logprob), most likely first."""


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled_token_ids: list[int]
    """One id per entry of plan.sampling_seqs, in that order (NONFINITE_TOKEN for a row whose logits were not
    finite)."""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """Aligned with sampled_token_ids when any row asked for logprobs (else empty)."""
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    """Request id -> logprobs of its prompt tokens computed this step (chunk order)."""
    later_token_ids: list[list[int]] = field(default_factory=list)
    """A plan of num_steps > 1: the ids of its steps 2..num_steps, each aligned with plan.sampling_seqs
    (sampled_token_ids holds the first step's)."""
