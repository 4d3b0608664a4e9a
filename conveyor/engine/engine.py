"""Engine: add_request / abort / step / has_work. step() is schedule -> run -> commit, nothing else."""

from __future__ import annotations

import itertools
import logging
import random
import time
from typing import Callable, Sequence, TypeVar

import torch

from conveyor.config import EngineConfig
from conveyor.openmp import warn_if_spinning
from conveyor.core.kv_cache import BlockManager
from conveyor.core.plan import StepPlan, StepResult
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerLimits
from conveyor.engine.grammars import EngineGrammars
from conveyor.engine.output import OutputProcessor
from conveyor.engine.stats import EngineStats
from conveyor.errors import InvalidRequestError
from conveyor.model.loader import load_model, model_path, resolve_dtype, resolve_max_model_len
from conveyor.model.runner import ModelRunner, PreparedStep
from conveyor.outputs import RequestOutput
from conveyor.params import SamplingParams
from conveyor.runtime.device import detect_device, resolve_async_batching
from conveyor.runtime.overlap import HostOverlapExecutor
from conveyor.runtime.pipelined import InflightStep, PipelinedExecutor
from conveyor.runtime.sync import SyncExecutor
from conveyor.runtime.timeline import StepTimeline
from conveyor.runtime.trace import Tracer

logger = logging.getLogger(__name__)
T = TypeVar("T")


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request (any int64 seed): sample 0 keeps the request's seed; the others stay
    on its side of zero (a negative seed s mirrors -1 - s), so distinct seeds never share a sample's seed."""
    if index == 0:
        return seed
    if seed < 0:
        return -1 - sample_seed(-1 - seed, index)
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        warn_if_spinning()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device_info = detect_device(config.device)
        self.async_batching = resolve_async_batching(config.async_batching, self.device_info)
        self.dtype = resolve_dtype(config.dtype, model_path(config.model), self.device_info.device.type,
                                   config.quantization)
        """The compute dtype in use ('auto' resolved)."""
        loaded = load_model(config.model, self.dtype)
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.model_source = loaded.source
        self.sampling_defaults = dict(loaded.sampling_defaults)
        self.max_model_len = resolve_max_model_len(loaded.spec, config.max_model_len)
        self.runner = ModelRunner(config, loaded, self.max_model_len, self.device_info)
        plan = self.runner.cache_plan
        self.blocks = BlockManager(plan.num_blocks, plan.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            loaded.spec.kv_window), self.blocks)
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, loaded.spec.eos_token_ids)
        self.timeline = StepTimeline()
        """The latest host and device spans (a bounded ring, always on); safe to read from any thread."""
        self.tracer = Tracer(enabled=False, timeline=self.timeline)
        self.executor: SyncExecutor | PipelinedExecutor | HostOverlapExecutor
        if not self.async_batching:
            self.executor = SyncExecutor(self.runner, self.tracer)
        elif self.device_info.is_cuda:
            self.executor = PipelinedExecutor(self.runner, self.tracer)
        else:
            self.executor = HostOverlapExecutor(self.runner, self.tracer)
        self._inflight: InflightStep | None = None  # CUDA pipeline: the launched step
        self._ready: tuple[StepPlan, PreparedStep] | None = None  # CPU overlap: the next step, prepared
        self._pending: tuple[StepPlan, StepResult] | None = None  # CPU overlap: run, not yet committed
        self.output_sink: Callable[[list[RequestOutput]], None] | None = None
        """Optional: CPU async batching hands the outputs its host thread commits to this callable,
        from that thread, while the forward pass is still running, instead of returning them from
        the `step()` that ends after the forward (one step earlier for streaming clients). It must
        be thread-safe; outputs of one request still arrive in order, before step() returns."""
        self.grammars = EngineGrammars(self.tokenizer, self.spec, config.structured_output_timeout,
                                       self.model_source)
        """Structured output: the grammar backend, per-sample matchers and each step's masks."""
        self._active_s = 0.0
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        logger.info("engine ready: %s on %s, dtype %s, max_model_len %d, %d KV blocks", self.model_source,
                    self.device_info.name, self.dtype, self.max_model_len, plan.num_blocks)

    # ---- requests -------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(f"model {self.model_source} has no tokenizer, so text prompts cannot be "
                                      f"used; pass token ids (a list of ints) instead")
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Admit a request (n samples when params.n > 1); returns its id. Raises InvalidRequestError."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else self._check_token_ids(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty (0 tokens); give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}, which leaves no "
                f"room for output; shorten the prompt to at most {self.max_model_len - 1} tokens or raise "
                f"max_model_len")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} samples cannot run together: max_num_seqs is "
                                      f"{self.config.max_num_seqs}; lower n or raise max_num_seqs")
        self._check_vocab(params)
        matchers = self.grammars.matchers(params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        sample_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [i for i in (request_id, *sample_ids) if i in self.outputs.groups or self.scheduler.get(i)]
        if taken:
            raise InvalidRequestError(f"request id {taken[0]!r} is already in use; ids must be unique")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        samples = []
        for i in range(params.n):
            samples.append(Request(
                request_id=sample_ids[i], prompt_token_ids=token_ids, params=params, seed=sample_seed(seed, i),
                arrival_index=next(self._ids), max_model_len=self.max_model_len,
                eos_token_ids=self.spec.eos_token_ids,
                fork_parent=None if i == 0 else samples[0].request_id))
        for request in samples:
            self.scheduler.add(request)
        self.outputs.track(request_id, text, samples, matchers)
        return request_id

    def _fill_grammar(self, plan: StepPlan, prepared: PreparedStep) -> None:
        self.grammars.fill(plan, prepared, self.outputs, self.tracer)

    def _check_vocab(self, params: SamplingParams) -> None:
        vocab = self.spec.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias)), ("stop_token_ids", list(params.stop_token_ids))):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(f"SamplingParams.{name} has token id {bad[0]}, outside the model's "
                                          f"vocabulary [0, {vocab})")

    def _check_token_ids(self, ids: Sequence[int]) -> list[int]:
        vocab = self.spec.vocab_size
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt token id {t!r} at index {i} is not an integer in [0, {vocab}) "
                                          f"(the model's vocabulary size is {vocab})")
            out.append(int(t))
        return out

    def abort(self, request_ids: str | Sequence[str], error: str | None = None) -> list[RequestOutput]:
        """End requests now (all their samples); one terminal output per request that was live."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            out = None
            for request in self.scheduler.abort(self.outputs.sample_ids(rid)):
                out = self.outputs.abort(request, error) or out
            if out is not None:
                outputs.append(out)
        return outputs

    # ---- the loop -------------------------------------------------------------------
    def has_work(self) -> bool:
        return (self.scheduler.has_work() or self._inflight is not None or self._ready is not None
                or self._pending is not None)

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns outputs of requests that got a token (or finished)."""
        start = time.perf_counter()
        try:
            if isinstance(self.executor, HostOverlapExecutor):
                return self._step_overlap(self.executor)
            if self.async_batching:
                return self._step_pipelined()
            return self._step_sync()
        finally:
            self._active_s += time.perf_counter() - start

    def _step_sync(self) -> list[RequestOutput]:
        with self.tracer.span("schedule"):
            plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        result = self.executor.wait(self.executor.submit(plan, lambda prepared: self._fill_grammar(plan, prepared)))
        with self.tracer.span("commit", step=plan.step_id):
            return self.outputs.commit(plan, result)

    def _step_pipelined(self) -> list[RequestOutput]:
        """Plan and launch step N+1 while step N runs, then finish step N.

        Blocks freed meanwhile (finish, abort, preemption) are held until the newest
        launched step has run, since it may still read them."""
        executor = self.executor
        current = self._inflight
        with self.tracer.span("schedule"):
            plan = self.scheduler.schedule()
        early: list[RequestOutput] = []
        if current is not None and any(s.sampling.constrained for s in plan.sampling_seqs if s.sampling):
            # Grammar masks need the in-flight step's tokens: finish it before launching this one.
            # (Here the CUDA pipeline loses its overlap for constrained steps; see README.)
            early = self._finish_inflight(current, plan.step_id)
            current = None
        following = None if plan.is_empty else executor.submit(plan, lambda p: self._fill_grammar(plan, p))
        if following is not None:
            self.scheduler.inflight_step = plan.step_id
        if current is None:  # the pipeline was empty: this call only fills it
            self._inflight = following
            if following is None:
                self.scheduler.inflight_step = None
            return early
        result = executor.wait(current)
        self.blocks.release_held(current.plan.step_id)
        self._inflight = following
        if following is None:
            self.scheduler.inflight_step = None
        with self.tracer.span("commit", step=current.plan.step_id):
            return self.outputs.commit(current.plan, result)

    def _finish_inflight(self, current: InflightStep, next_step: int) -> list[RequestOutput]:
        """Wait for and commit the in-flight step before `next_step` (planned, not launched) goes out;
        blocks this commit frees are held until `next_step` has run, as it may still read them."""
        result = self.executor.wait(current)
        self.blocks.release_held(current.plan.step_id)
        self._inflight = None
        self.scheduler.inflight_step = next_step
        with self.tracer.span("commit", step=current.plan.step_id):
            return self.outputs.commit(current.plan, result)

    def _commit_pending(self) -> list[RequestOutput]:
        if self._pending is None:
            return []
        plan, result = self._pending
        self._pending = None
        with self.tracer.span("commit", step=plan.step_id):
            return self.outputs.commit(plan, result)

    def _schedule_and_prepare(self, executor: HostOverlapExecutor,
                              previous: StepPlan | None) -> tuple[StepPlan, PreparedStep] | None:
        with self.tracer.span("schedule"):
            plan = self.scheduler.schedule()
        return None if plan.is_empty else (plan, executor.prepare(plan, previous))

    def _step_overlap(self, executor: HostOverlapExecutor) -> list[RequestOutput]:
        """CPU async batching: run step N here while the host thread commits N-1 and schedules
        and prepares N+1 (placeholders for N's tokens). Blocks freed meanwhile are held until
        the step that may read them has run."""
        outputs: list[RequestOutput] = []
        if self._ready is None:  # nothing prepared: catch up on the host side first
            outputs = self._commit_pending()
            self._ready = self._schedule_and_prepare(executor, None)
            if self._ready is None:
                self.scheduler.inflight_step = None
                return outputs
        plan = self._ready[0]

        def host_work(committed: list[RequestOutput]) -> tuple[list[RequestOutput],
                                                               tuple[StepPlan, PreparedStep] | None]:
            if self.output_sink is not None and committed:  # out now, not when this forward ends
                self.output_sink(committed)
                committed = []
            return committed, self._schedule_and_prepare(executor, plan)

        committed, following = self._run_ready(executor, host_work)
        self._ready = following
        self.scheduler.inflight_step = following[0].step_id if following else None
        if self._samples_first_token(plan):
            # A request's first token goes out now, not one step later: TTFT is not charged a decode
            # step for the overlap (measured +35 ms on a single float32 request). N+1 is prepared
            # already, with placeholders; blocks this commit frees are held until N+1 has run.
            committed += self._commit_pending()
        return outputs + committed

    def _samples_first_token(self, plan: StepPlan) -> bool:
        for seq in plan.seqs:
            request = self.scheduler.get(seq.request_id) if seq.sampling is not None else None
            if request is not None and request.num_output_tokens == 0:
                return True
        return False

    def _run_ready(self, executor: HostOverlapExecutor, after_commit: Callable[[list[RequestOutput]], T]) -> T:
        """Run the prepared step while the host thread commits the step before it, fills this step's
        grammar masks (the forward waits for them only when it reaches sampling), then runs
        `after_commit(committed outputs)`. The step's result waits in `_pending` for the next commit.
        Returns what after_commit returned."""
        assert self._ready is not None
        plan, prepared = self._ready
        self._ready = None
        self.scheduler.inflight_step = plan.step_id

        def host_work() -> T:
            try:
                committed = self._commit_pending()
                self._fill_grammar(plan, prepared)
            finally:
                if prepared.grammar is not None:  # never leave the forward waiting for masks that cannot come
                    prepared.grammar.fail(RuntimeError(f"step {plan.step_id}: the host failed before its grammar "
                                                       f"masks were ready"))
            return after_commit(committed)

        result, host_result = executor.run_with_host(plan, prepared, host_work)
        self.blocks.release_held(plan.step_id)
        self._pending = (plan, result)
        return host_result

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight, if any, without launching another."""
        if isinstance(self.executor, HostOverlapExecutor):
            outputs = [] if self._ready is None else self._run_ready(self.executor, lambda committed: committed)
            self.scheduler.inflight_step = None
            return outputs + self._commit_pending()
        if self._inflight is None:
            return []
        current, self._inflight = self._inflight, None
        result = self.executor.wait(current)
        self.blocks.release_held(current.plan.step_id)
        self.scheduler.inflight_step = None
        return self.outputs.commit(current.plan, result)

    def close(self) -> None:
        """Finish the step in flight (if any) and stop the executor's worker."""
        self.drain()
        self.executor.close()

    def start_trace(self) -> None:
        self.tracer.start()

    def save_trace(self, path: str) -> None:
        self.tracer.save(path)

    def stats(self) -> EngineStats:
        s, b = self.scheduler, self.blocks
        return EngineStats(num_running=len(s.running), num_waiting=len(s.waiting), num_steps=s.stats.num_steps,
                           num_preemptions=s.stats.num_preemptions, num_partial_prefills=s.stats.num_partial_prefills,
                           kv_blocks_total=b.num_blocks, kv_blocks_free=b.num_free_blocks,
                           kv_blocks_cached=b.num_cached_blocks, prefix_hit_tokens=b.prefix_hit_tokens,
                           prefix_query_tokens=b.prefix_queries_tokens,
                           num_preempted_waiting=sum(1 for r in s.waiting if r.num_preemptions),
                           num_generated_tokens=self.outputs.num_generated_tokens,
                           async_batching=self.async_batching, device_busy_s=self.executor.device_busy_s,
                           active_s=self._active_s)

    def check_idle(self) -> None:
        """When no request is left, every block must be free or cached (no leak)."""
        self.blocks.check_invariants()
        if not self.has_work():
            assert self.blocks.num_allocated == 0, f"{self.blocks.num_allocated} KV blocks leaked"

