"""Commit a step's results: append tokens, check stops, detokenize, build RequestOutputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.plan import StepPlan, StepResult
from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler import Scheduler
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.outputs import CompletionOutput, RequestOutput


@dataclass
class RequestState:
    """Per-request things only the output side needs."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.states: dict[str, RequestState] = {}
        self.num_generated_tokens = 0

    def track(self, request: Request, prompt: str | None) -> None:
        self.states[request.request_id] = RequestState(
            request, prompt, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids))

    def commit(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply sampled tokens; finished requests leave the scheduler and free their blocks."""
        outputs = []
        now = time.perf_counter()
        for seq, token_id in zip(plan.sampling_seqs, result.sampled_token_ids):
            state = self.states.get(seq.request_id)
            if state is None or state.request.is_finished:
                continue  # aborted while its step was in flight: the token is dropped
            request = state.request
            self.scheduler.commit_token(request, token_id)
            self.num_generated_tokens += 1
            state.detokenizer.add(token_id)
            if state.first_token_time is None:
                state.first_token_time = now
            status = self._stop_status(request, token_id)
            if status is not None:
                self.scheduler.finish(request, status)
            outputs.append(self.output_of(state))
        return outputs

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        p = request.params
        if token_id in self.eos_token_ids and not p.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in p.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= p.max_tokens or request.num_tokens >= request.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_aborted(self, request: Request, error: str | None = None) -> RequestOutput:
        state = self.states[request.request_id]
        out = self.output_of(state)
        out.error = error
        return out

    def output_of(self, state: RequestState) -> RequestOutput:
        request = state.request
        finished = request.is_finished
        if finished:
            state.detokenizer.finish()
            del self.states[request.request_id]
        metrics = {}
        if state.first_token_time is not None:
            metrics["ttft_s"] = state.first_token_time - state.arrival_time
        completion = CompletionOutput(index=0, text=state.detokenizer.text, token_ids=request.output_token_ids,
                                      finish_reason=request.finish_reason, stop_reason=request.stop_reason)
        return RequestOutput(request_id=request.request_id, prompt=state.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=finished,
                             num_cached_tokens=request.num_cached_tokens, metrics=metrics)
