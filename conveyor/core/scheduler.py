"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each step: running requests first (decodes and unfinished prefill chunks, oldest first),
then waiting requests FCFS while the token budget, `max_num_seqs` and free blocks allow.
When blocks run out, the newest running request is preempted (its blocks freed, its
tokens recomputed later). Knows nothing of tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.kv_cache import EMPTY_MATCH, BlockManager
from conveyor.core.plan import PLACEHOLDER_TOKEN, SamplingSpec, ScheduledSeq, StepPlan
from conveyor.core.request import Request, RequestStatus
from conveyor.core.step_tokens import StepTokens


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_window: int | None = None
    """The sliding window every layer of the model shares: blocks behind it are freed while a request runs."""
    max_decode_steps: int = 1
    """Most decode steps one plan may run back to back (StepPlan.num_steps; EngineConfig.num_scheduler_steps)."""


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_partial_prefills: int = 0
    """Prefill chunks planned that did not reach the end of the known tokens."""
    step_tokens: StepTokens = field(default_factory=StepTokens)
    """Tokens per step planned, as vLLM counts an iteration's (core/step_tokens.py)."""


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager) -> None:
        self.limits = limits
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._requests: dict[str, Request] = {}
        self._next_step_id = 0
        self._awaiting_fork: dict[str, list[Request]] = {}
        self._fixed_sampling: dict[str, dict[str, Any]] = {}
        """Per request: the SamplingSpec fields that never change while it lives."""
        self._table_sent: dict[str, int] = {}
        """Per request the runner holds: leading block table entries it has and that are still right."""
        self._history_sent: dict[str, int] = {}
        """Per request with a penalty the runner holds: how many of its known ids it has."""
        self._dropped: list[str] = []
        """Requests the runner holds that ended or were preempted: the next non-empty plan drops them."""

    # ---- membership -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use; ids must be unique")
        self._requests[request.request_id] = request
        if request.fork_parent is not None:
            self._awaiting_fork.setdefault(request.fork_parent, []).append(request)
        else:
            self.waiting.append(request)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def finish(self, request: Request, status: RequestStatus, in_flight: int | None = None) -> None:
        """Move a request to a terminal state and release its blocks (idempotent). `in_flight`: the newest
        step submitted and not finished, which may still read the blocks (they are held until it is)."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.fork_parent is not None and request in self._awaiting_fork.get(request.fork_parent, ()):
            self._awaiting_fork[request.fork_parent].remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self._release(request.request_id, in_flight)
        del self._requests[request.request_id]
        self._fixed_sampling.pop(request.request_id, None)
        for orphan in self._awaiting_fork.pop(request.request_id, []):  # its samples never forked
            orphan.status = status
            del self._requests[orphan.request_id]

    def abort(self, request_ids: Iterable[str], in_flight: int | None = None) -> list[Request]:
        """End the live ones of these requests; `in_flight` as in `finish`."""
        aborted = []
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is not None:
                self.finish(request, RequestStatus.FINISHED_ABORTED, in_flight)
                aborted.append(request)
        return aborted

    # ---- planning -------------------------------------------------------------------
    def schedule(self, in_flight: int | None = None) -> StepPlan:
        """Plan the next step. `in_flight`: the newest step submitted and not finished (None when none is);
        blocks this planning frees (preemption, a sliding window passing them) are held until it finishes,
        since it may still read them."""
        budget = self.limits.max_num_batched_tokens
        planned: list[tuple[Request, int]] = []
        copies: list[tuple[int, int]] = []
        num_preempted = 0

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            count = min(request.num_tokens_to_compute, budget)
            if count <= 0 or (request.num_inflight_tokens and request.reached_length_limit):
                i += 1
                continue
            start = request.num_computed_tokens
            # with a window, the queries from `start` on attend to start - W + 1 onward
            if self.limits.kv_window is not None and self.blocks.free_behind(
                request.request_id, start - self.limits.kv_window + 1, in_flight
            ):
                self._table_changed(request.request_id, 0)  # rare (once a block): the table goes whole
            if self.blocks.holds_privately(request.request_id, start + count, start):  # nothing to allocate
                planned.append((request, count))
                budget -= count
                i += 1
                continue
            while not self.blocks.can_allocate(request.request_id, start + count, write_from=start):
                victim = self.running[-1]
                self._preempt(victim, in_flight)
                num_preempted += 1
                if victim is request:
                    break
            else:
                copy = self.blocks.copy_on_write(request.request_id, start)
                if copy is not None:
                    copies.append(copy)
                    self._table_changed(request.request_id, start // self.blocks.block_size)
                self.blocks.allocate(request.request_id, start + count)
                planned.append((request, count))
                budget -= count
                i += 1

        while self.waiting and budget > 0 and num_preempted == 0:
            request = self.waiting[0]
            group = 1 + len(self._awaiting_fork.get(request.request_id, ()))
            if self.running and len(self.running) + group > self.limits.max_num_seqs:
                break
            reuse = request.num_computed_tokens == 0 and request.params.prompt_logprobs is None
            prefix = self.blocks.find_cached_prefix(request.token_ids) if reuse else EMPTY_MATCH
            start = prefix.num_tokens
            count = min(request.num_tokens_to_compute - start, budget)
            if not self.blocks.can_allocate(request.request_id, start + count, prefix):
                break
            self.blocks.allocate(request.request_id, start + count, prefix)
            self.blocks.count_prefix_query(request.num_tokens)
            self.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = start
            request.num_cached_tokens = start
            self.running.append(request)
            planned.append((request, count))
            budget -= count

        steps = self._decode_steps(planned, num_preempted) if self.limits.max_decode_steps > 1 else 1
        seqs: list[ScheduledSeq] = []
        prompt_tokens = 0  # the whole prompt of each sequence sampling its first token (see core/step_tokens.py)
        for request, count in planned:
            seqs.append(self._plan_seq(request, count, steps))
            if seqs[-1].sampling is not None and seqs[-1].start_position < request.num_prompt_tokens:
                prompt_tokens += request.num_prompt_tokens
            if seqs[-1].sampling is not None and request.request_id in self._awaiting_fork:
                forks = self._fork(request, seqs[-1])
                prompt_tokens += len(forks) * request.num_prompt_tokens
                seqs.extend(forks)
        if seqs:
            sampled = sum(1 for seq in seqs if seq.sampling is not None)
            self.stats.step_tokens.observe(prompt_tokens + sampled)
            if steps > 1:  # the plan's later steps (decodes only)
                self.stats.step_tokens.observe(sampled, steps - 1)
        dropped: list[str] = []
        if seqs:  # an empty plan is never run: the drops wait for one that is
            dropped, self._dropped = self._dropped, []
        plan = StepPlan(self._next_step_id, seqs, num_preempted, copies, dropped, steps)
        self._next_step_id += 1
        self.stats.num_steps += 1
        self.stats.num_preemptions += num_preempted
        return plan

    def _decode_steps(self, planned: list[tuple[Request, int]], num_preempted: int) -> int:
        """How many decode steps this plan runs back to back (StepPlan.num_steps), its blocks allocated: more than
        one only when nothing waits or was preempted and every planned request is a multi-step one (Request.
        multi_step) decoding one token, past min_tokens, with that many tokens left before max_tokens and
        max_model_len, and the free blocks hold them all."""
        if self.waiting or num_preempted or not planned:
            return 1
        steps = self.limits.max_decode_steps
        for request, count in planned:
            if count != 1 or not request.multi_step or request.num_tokens_to_compute != 1:
                return 1
            p = request.params
            produced = request.num_output_tokens + request.num_inflight_tokens
            left = self.limits.max_model_len - request.num_tokens - request.num_inflight_tokens
            if p.max_tokens is not None:
                left = min(left, p.max_tokens - produced)
            steps = min(steps, left)
            if steps <= 1 or produced < p.min_tokens:
                return 1
        needed = sum(self.blocks.new_blocks_needed(r.request_id, r.num_computed_tokens + steps) for r, _ in planned)
        if needed > self.blocks.num_free_blocks:
            return 1
        for request, _ in planned:  # the first step's block is private already (the loop above made it so)
            self.blocks.allocate(request.request_id, request.num_computed_tokens + steps)
        return steps

    def _plan_seq(self, request: Request, count: int, steps: int = 1) -> ScheduledSeq:
        start = request.num_computed_tokens
        known = request.token_ids[start : start + count]
        inputs = known + [PLACEHOLDER_TOKEN] * (count - len(known))
        request.num_computed_tokens = start + count
        self.blocks.register_full_blocks(request.request_id, request.token_ids, min(start + count, request.num_tokens))
        sampling = None
        if request.num_tokens_to_compute == 0:
            sampling = self._sampling_spec(request)
            request.num_inflight_tokens += steps  # steps > 1: the later steps' inputs are this plan's own samples
            request.num_computed_tokens += steps - 1
        else:
            self.stats.num_partial_prefills += 1
        targets, num_prompt_logprobs = None, 0
        if request.params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
            prompt = request.prompt_token_ids
            targets = [prompt[p + 1] if p + 1 < len(prompt) else -1 for p in range(start, start + count)]
            num_prompt_logprobs = request.params.prompt_logprobs
        table_start, table_tail = self._table_delta(request.request_id)
        return ScheduledSeq(
            request.request_id,
            inputs,
            start,
            table_tail,
            table_start,
            sampling,
            prompt_logprob_targets=targets,
            num_prompt_logprobs=num_prompt_logprobs,
            arrival_index=request.arrival_index,
        )

    def _table_delta(self, request_id: str) -> tuple[int, list[int]]:
        """(entries the runner keeps, the entries after them): see core/persistent_batch.py."""
        table = self.blocks.block_table(request_id)
        start = self._table_sent.get(request_id, 0)
        self._table_sent[request_id] = len(table)
        return start, table[start:]

    def _table_changed(self, request_id: str, index: int) -> None:
        """Entry `index` of the request's block table changed: the runner's copy is right only before it."""
        if request_id in self._table_sent:
            self._table_sent[request_id] = min(self._table_sent[request_id], index)

    def _release(self, request_id: str, in_flight: int | None) -> None:
        """The request leaves the running set (finished or preempted): its blocks are freed (held until
        `in_flight` finishes) and the runner forgets its state with the next plan."""
        self.blocks.free(request_id, hold_until_step=in_flight)
        self._forget_sent(request_id)

    def _forget_sent(self, request_id: str) -> None:
        """Drop the request's state in the runner with the next plan."""
        sent = self._table_sent.pop(request_id, None) is not None
        if self._history_sent.pop(request_id, None) is not None or sent:
            self._dropped.append(request_id)

    def _sampling_spec(self, request: Request) -> SamplingSpec:
        p = request.params
        produced = request.num_output_tokens + request.num_inflight_tokens
        history_tail, history_start = None, 0
        if p.has_penalties:  # the ids the runner has not been sent; in-flight ones it fills itself
            history_start = self._history_sent.get(request.request_id, 0)
            history_tail = tuple(request.token_ids[history_start:])
            self._history_sent[request.request_id] = request.num_tokens
        suppress: tuple[int, ...] = ()
        if produced < p.min_tokens:
            suppress = tuple(sorted(set(request.eos_token_ids) | set(p.stop_token_ids)))
        fixed = self._fixed_sampling.get(request.request_id)
        if fixed is None:  # what never changes while the request lives: built once, not every step
            fixed = self._fixed_sampling[request.request_id] = dict(
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                seed=request.seed,
                min_p=p.min_p,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty,
                logit_bias=tuple(sorted(p.logit_bias.items())),
                num_prompt_tokens=request.num_prompt_tokens,
                logprobs=p.logprobs,
                constrained=p.structured_outputs is not None,
            )
        return SamplingSpec(
            output_index=produced,
            suppress_token_ids=suppress,
            history_tail=history_tail,
            history_start=history_start,
            num_history_placeholders=request.num_inflight_tokens,
            **fixed,
        )

    def _fork(self, parent: Request, parent_seq: ScheduledSeq) -> list[ScheduledSeq]:
        """Samples 1..n-1 of an n > 1 request join now: they share the parent's prompt blocks and
        draw their first token from the parent's logits row with their own random streams."""
        seqs = []
        for child in self._awaiting_fork.pop(parent.request_id):
            self.blocks.fork(parent.request_id, child.request_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = RequestStatus.RUNNING
            child.fork_parent = None
            self.running.append(child)
            sampling = self._sampling_spec(child)
            child.num_inflight_tokens += 1
            table_start, table_tail = self._table_delta(child.request_id)
            seqs.append(
                ScheduledSeq(
                    child.request_id,
                    [],
                    parent_seq.context_len,
                    table_tail,
                    table_start,
                    sampling,
                    sample_from=parent.request_id,
                    arrival_index=child.arrival_index,
                )
            )
        return seqs

    def _preempt(self, request: Request, in_flight: int | None) -> None:
        """Free the request's blocks and queue it first in line for recomputation."""
        self.running.remove(request)
        self._release(request.request_id, in_flight)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- committing -----------------------------------------------------------------
    def commit_token(self, request: Request, token_id: int) -> None:
        """Record a sampled token of a planned step (the caller then checks stops)."""
        request.num_inflight_tokens -= 1
        request.token_ids.append(token_id)
