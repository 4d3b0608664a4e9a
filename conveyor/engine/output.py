"""Commit a step's results: append tokens, check stops, detokenize, build RequestOutputs.

A user request with n samples is a group of n scheduler requests; its RequestOutput
carries all n completions and is finished once every sample is.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.plan import NONFINITE_TOKEN, StepPlan, StepResult, TokenLogprobs
from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler import Scheduler
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.outputs import NON_FINITE_LOGITS, CompletionOutput, PositionLogprobs, RequestOutput
from conveyor.structured.backend import GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass
class SampleState:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    """Text shown so far: the tail that could still begin a stop string is held back."""
    logprobs: list[PositionLogprobs] | None = None
    stop_floor: int = 0
    """A stop string must end past this many characters: text made before min_tokens cannot stop alone."""
    cut_at: int | None = None
    """Where the text ends when a stop token (or EOS) ended it: its own text is left out, as in vLLM."""
    matcher: GrammarMatcher | None = None
    """Structured output: this sample's grammar state, advanced once per committed token."""


@dataclass
class GroupState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None
    error_code: str | None = None
    final_only: bool = False
    """commit() gives this request's output only when it ends (Engine.add_request's final_only)."""

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.groups: dict[str, GroupState] = {}
        self._sample_of: dict[str, SampleState] = {}
        self._group_of: dict[str, GroupState] = {}
        self.num_generated_tokens = 0
        self.num_non_finite = 0
        """Requests (groups) ended because the model's logits were not finite."""
        decode = functools.lru_cache(maxsize=65536)(lambda token_id: str(tokenizer.decode([token_id])))
        self._decode: Callable[[int], str] | None = decode if tokenizer is not None else None
        """Token id -> text, for the decoded_token of vLLM-shaped logprobs (computed when read)."""

    def track(
        self,
        request_id: str,
        prompt: str | None,
        samples: list[Request],
        matchers: list[GrammarMatcher] | None = None,
        final_only: bool = False,
    ) -> None:
        p = samples[0].params
        group = GroupState(request_id, prompt, samples[0].prompt_token_ids, [], final_only=final_only)
        for i, request in enumerate(samples):
            state = SampleState(
                i,
                request,
                IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.skip_special_tokens),
                logprobs=[] if p.logprobs is not None else None,
                matcher=matchers[i] if matchers else None,
            )
            group.samples.append(state)
            self._sample_of[request.request_id] = state
            self._group_of[request.request_id] = group
        if p.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self.groups[request_id] = group

    def sample_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [] if group is None else [s.request.request_id for s in group.samples]

    def matchers_of(self, plan: StepPlan) -> list[GrammarMatcher | None]:
        """The grammar state of each constrained sampled row of `plan`, in row order (None for a sample
        that ended meanwhile: its token will be dropped, any mask does)."""
        out: list[GrammarMatcher | None] = []
        for seq in plan.sampling_seqs:
            if seq.sampling is None or not seq.sampling.constrained:
                continue
            state = self._sample_of.get(seq.request_id)
            live = (
                state is not None and not state.request.is_finished and state.request.arrival_index == seq.arrival_index
            )
            out.append(state.matcher if live and state is not None else None)
        return out

    def commit(self, plan: StepPlan, result: StepResult, in_flight: int | None = None) -> list[RequestOutput]:
        """Apply sampled tokens; finished requests leave the scheduler and free their blocks (held until
        step `in_flight`, the newest still running, has finished)."""
        touched: dict[str, GroupState] = {}
        now = time.perf_counter()
        for seq in plan.seqs:
            values = result.prompt_logprobs.get(seq.request_id)
            group = self._group_of.get(seq.request_id)
            if values is None or group is None or group.prompt_logprobs is None:
                continue
            for j, value in enumerate(values):  # value j is about prompt token start + j + 1
                if value is not None and seq.start_position + j + 1 == len(group.prompt_logprobs):
                    # a recompute after preemption adds nothing twice
                    group.prompt_logprobs.append(PositionLogprobs.of(value, self._decode))
        logprobs = result.logprobs or [None] * len(result.sampled_token_ids)
        later = result.later_token_ids  # a multi-step plan's steps 2..n: each row's next tokens, in order
        for row, (seq, token_id, lp) in enumerate(zip(plan.sampling_seqs, result.sampled_token_ids, logprobs)):
            state = self._sample_of.get(seq.request_id)
            if state is None or state.request.is_finished or state.request.arrival_index != seq.arrival_index:
                continue  # finished or aborted while its step was in flight (maybe its id reused): dropped
            self._commit_token(state, token_id, lp, now, in_flight)
            for tokens in later:
                if state.request.is_finished:
                    break  # the tokens past a stop (or max_tokens, or an error) are dropped
                self._commit_token(state, tokens[row], None, now, in_flight)
            group = self._group_of[state.request.request_id]
            touched[group.request_id] = group
        return [self.output_of(g) for g in touched.values() if g.finished or not g.final_only]

    def _commit_token(
        self, state: SampleState, token_id: int, lp: TokenLogprobs | None, now: float, in_flight: int | None
    ) -> None:
        """One sampled token: appended, detokenized, stops checked (the request finished when one holds); or, for
        NONFINITE_TOKEN, the sample ended with an error."""
        request = state.request
        if token_id == NONFINITE_TOKEN:
            self._end_non_finite(state, in_flight)
            return
        self.scheduler.commit_token(request, token_id)
        self.num_generated_tokens += 1
        text_before = len(state.detokenizer.text)
        state.detokenizer.add(token_id)
        if request.num_output_tokens < request.params.min_tokens:
            state.stop_floor = len(state.detokenizer.text)
        if state.logprobs is not None and lp is not None:
            state.logprobs.append(PositionLogprobs.of(lp, self._decode))
        group = self._group_of[request.request_id]
        if group.first_token_time is None:
            group.first_token_time = now
        status = self._stop_status(state, token_id)
        ended_by_token = status is RequestStatus.FINISHED_STOPPED and not isinstance(request.stop_reason, str)
        if ended_by_token and not request.params.include_stop_str_in_output:
            state.cut_at = text_before  # EOS or a stop token id: its text is not output
        if state.matcher is not None:
            status = self._advance_grammar(state, token_id, status)
        if status is not None:
            self.scheduler.finish(request, status, in_flight)
        self._update_text(state)

    def _end_non_finite(self, state: SampleState, in_flight: int | None) -> None:
        """The model's logits for this sample's next token held NaN or +inf: nothing can be drawn from them, so the
        sample ends with an error (its output so far kept), and its request fails with a message that says so."""
        request = state.request
        group = self._group_of[request.request_id]
        if group.error_code != NON_FINITE_LOGITS:
            self.num_non_finite += 1
            logger.error(
                "request %s: the model's logits were not finite at output token %d; the request ended with an error",
                group.request_id,
                request.num_output_tokens,
            )
        group.error_code = NON_FINITE_LOGITS
        group.error = (
            f"the model's logits were not finite (NaN or infinity) at output token {request.num_output_tokens} of "
            f"this request, so no token could be sampled; the request was ended. This is a fault of the model or "
            f"the engine, not of the request: check the model file (conveyor inspect), or try another dtype"
        )
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, in_flight)
        self._update_text(state)

    def _advance_grammar(self, state: SampleState, token_id: int, status: RequestStatus | None) -> RequestStatus | None:
        """One committed token, one grammar step. A complete grammar stops the sample ("stop"); a token the
        grammar refuses (impossible with its mask applied) ends it with an error rather than invalid output."""
        assert state.matcher is not None
        if not state.matcher.accept(token_id):
            group = self._group_of[state.request.request_id]
            group.error_code = "grammar"
            group.error = (
                f"structured output: the grammar refused token {token_id} ({state.matcher.error or 'not allowed here'})"
            )
            return RequestStatus.FINISHED_ERROR
        if status is None and state.matcher.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        return status

    def _stop_status(self, state: SampleState, token_id: int) -> RequestStatus | None:
        request = state.request
        p = request.params
        if token_id in self.eos_token_ids and not p.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in p.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if p.stop and request.num_output_tokens >= p.min_tokens and self._find_stop_string(state):
            return RequestStatus.FINISHED_STOPPED
        if (
            p.max_tokens is not None and request.num_output_tokens >= p.max_tokens
        ) or request.num_tokens >= request.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _find_stop_string(self, state: SampleState) -> bool:
        """Search the newly decoded text (and the tail it may complete) for a stop string."""
        p = state.request.params
        text = state.detokenizer.text
        longest = max(len(s) for s in p.stop)
        search_from = max(0, len(state.text) - longest)
        hits = [(i, s) for s in p.stop if (i := text.find(s, max(search_from, state.stop_floor - len(s) + 1))) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        state.text = text[: index + (len(stop) if p.include_stop_str_in_output else 0)]
        state.request.stop_reason = stop
        return True

    def _update_text(self, state: SampleState) -> None:
        request = state.request
        if request.stop_reason is not None and isinstance(request.stop_reason, str):
            return  # cut at the stop string already
        if request.is_finished:
            state.detokenizer.finish()
            state.text = state.detokenizer.text if state.cut_at is None else state.detokenizer.text[: state.cut_at]
            return
        text = state.detokenizer.text
        stops = request.params.stop
        hold = max(len(s) for s in stops) - 1 if stops else 0
        state.text = text[: max(0, len(text) - hold)] if hold else text

    def abort(
        self, request: Request, error: str | None = None, error_code: str = "engine_error"
    ) -> RequestOutput | None:
        """Output for a sample ended outside commit (abort / error); one per group once all ended."""
        group = self._group_of.get(request.request_id)
        if group is None:
            return None
        self._update_text(self._sample_of[request.request_id])  # flush the held-back tail
        if error is not None:
            group.error, group.error_code = error, error_code
        return self.output_of(group) if group.finished else None

    def output_of(self, group: GroupState) -> RequestOutput:
        finished = group.finished
        if finished:
            self.groups.pop(group.request_id, None)
            for s in group.samples:
                self._sample_of.pop(s.request.request_id, None)
                self._group_of.pop(s.request.request_id, None)
        metrics: dict[str, float] = {}
        if group.first_token_time is not None:
            metrics["ttft_s"] = group.first_token_time - group.arrival_time
        scheduled = group.samples[0].request.first_scheduled_time
        if scheduled is not None:
            metrics["queued_s"] = max(0.0, scheduled - group.arrival_time)
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=s.request.output_token_ids,
                finish_reason=s.request.finish_reason,
                stop_reason=s.request.stop_reason,
                logprobs=None if s.logprobs is None else list(s.logprobs),
            )
            for s in group.samples
        ]
        first = group.samples[0].request
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            error=group.error,
            error_code=group.error_code,
            metrics=metrics,
            prompt_logprobs=None if group.prompt_logprobs is None else list(group.prompt_logprobs),
        )
