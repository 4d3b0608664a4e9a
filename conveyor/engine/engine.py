"""Engine: add_request / abort / step / has_work. step() is schedule -> submit -> wait -> commit, nothing else.

Threads, and what each owns:

- The engine thread (whoever calls the Engine's methods: LLM's caller, AsyncEngine's loop thread) owns
  the engine between step() calls: add_request, abort, stats, drain. It also runs every large tensor
  op (the forward), on CPU inside step() through the executor's `serve`.
- During a step() under CPU async batching, the host thread ("conveyor-host") runs the host turn:
  the scheduler, the block manager, the output processor (detokenizer, stops), grammar masks and
  the prepare of step tensors (with the runner's persistent batch, which only prepare touches). The engine
  thread only computes forwards meanwhile and touches none of them; step() returns only after the host turn
  ended, so ownership passes back whole.
- The engine's tokenizer is used by one of those two threads at a time (tokenize on admission,
  detokenize in commit), never by both at once. Frontends get their own copy (EngineInfo.tokenizer
  from AsyncEngine), so server threads tokenizing never share a tokenizer with the engine (a shared
  fast tokenizer can fail with "Already borrowed").
- The StepTimeline and the output sink are the only things other threads read or receive while a
  step runs; both are thread-safe.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from conveyor.config import EngineConfig
from conveyor.core.kv_cache import BlockManager
from conveyor.core.plan import StepPlan
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerLimits
from conveyor.device import detect_device
from conveyor.engine.grammars import EngineGrammars
from conveyor.engine.info import EngineInfo
from conveyor.engine.output import OutputProcessor
from conveyor.engine.stats import EngineStats
from conveyor.errors import ConfigError, InvalidRequestError
from conveyor.model.loader import load_model, model_path, resolve_dtype, resolve_max_model_len
from conveyor.model.runner import ModelRunner
from conveyor.openmp import warn_if_spinning
from conveyor.outputs import RequestOutput
from conveyor.params import SamplingParams
from conveyor.runtime import Executor, StepHandle, make_executor
from conveyor.runtime.async_mode import resolve_async_batching
from conveyor.runtime.timeline import StepTimeline
from conveyor.runtime.trace import Tracer

logger = logging.getLogger(__name__)


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request (any int64 seed): sample 0 keeps the request's seed; the others stay
    on its side of zero (a negative seed s mirrors -1 - s), so distinct seeds never share a sample's seed."""
    if index == 0:
        return seed
    if seed < 0:
        return -1 - sample_seed(-1 - seed, index)
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


def _plain_greedy(params: SamplingParams) -> bool:
    """Each token is the raw argmax, whatever came before it in the batch or the output: greedy, one sample, with
    no penalty, bias, logprobs or grammar (min_tokens is the scheduler's to check). Such a request, returned only
    at its end, may run several decode steps per plan (EngineConfig.num_scheduler_steps)."""
    return (
        params.is_greedy
        and params.n == 1
        and not params.has_penalties
        and not params.logit_bias
        and params.logprobs is None
        and params.structured_outputs is None
    )


class Engine:
    def __init__(self, config: EngineConfig, output_sink: Callable[[list[RequestOutput]], None] | None = None) -> None:
        if config.data_parallel_size > 1:  # one engine is one replica: refused, not run as one silently
            raise ConfigError(
                f"Engine runs one replica, but data_parallel_size={config.data_parallel_size}; "
                f"LLM(...) and `conveyor serve` start the replicas on Ray"
            )
        self.config = config
        warn_if_spinning()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device_info = detect_device(config.device)
        self.async_batching = resolve_async_batching(config.async_batching, self.device_info)
        self.dtype = resolve_dtype(
            config.dtype, model_path(config.model), self.device_info.device.type, config.quantization
        )
        """The compute dtype in use ('auto' resolved)."""
        loaded = load_model(config.model, self.dtype)
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.model_source = loaded.source
        self.sampling_defaults = dict(loaded.sampling_defaults)
        self.max_model_len = resolve_max_model_len(loaded.spec, config.max_model_len)
        if config.tensor_parallel_size > 1:
            from conveyor.tensor_parallel.launch import start_tensor_parallel  # ranks 1..N-1 in their own processes

            self.runner: ModelRunner = start_tensor_parallel(
                config, loaded, self.dtype, self.max_model_len, self.device_info
            )
        else:
            self.runner = ModelRunner(config, loaded, self.max_model_len, self.device_info)
        plan = self.runner.cache_plan
        self.blocks = BlockManager(plan.num_blocks, plan.block_size, config.enable_prefix_caching)
        one_step = config.tensor_parallel_size > 1 or loaded.spec.kv_window is not None  # see num_scheduler_steps
        self.scheduler = Scheduler(
            SchedulerLimits(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                loaded.spec.kv_window,
                1 if one_step else config.num_scheduler_steps,
            ),
            self.blocks,
        )
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, loaded.spec.eos_token_ids)
        self.timeline = StepTimeline()
        """The latest host and device spans (a bounded ring, always on); safe to read from any thread."""
        self.tracer = Tracer(enabled=False, timeline=self.timeline)
        self.executor: Executor = make_executor(self.async_batching, self.runner, self.tracer)
        self._inflight: deque[StepHandle] = deque()
        """Steps submitted and not yet finished, oldest first (at most executor.depth)."""
        self._host_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-host")
        """Where the host turn runs while the executor computes on the engine's thread (CPU overlap)."""
        self.output_sink = output_sink
        """Optional: CPU async batching hands the outputs its host thread commits to this callable,
        from that thread, while the forward pass is still running, instead of returning them from
        the `step()` that ends after the forward (one step earlier for streaming clients). It must
        be thread-safe; outputs of one request still arrive in order, before step() returns."""
        self.grammars = EngineGrammars(
            self.tokenizer,
            self.spec,
            config.structured_output_timeout,
            self.model_source,
            masks_when_sampled=not self.device_info.is_cuda,
        )
        """Structured output: the grammar backend, per-sample matchers and each step's masks."""
        self._active_s = 0.0
        self._turn_running = False
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.info = EngineInfo(
            model_source=self.model_source,
            tokenizer=self.tokenizer,
            vocab_size=self.spec.vocab_size,
            max_model_len=self.max_model_len,
            sampling_defaults=EngineInfo.freeze(self.sampling_defaults),
            eos_token_ids=tuple(self.spec.eos_token_ids),
            dtype=str(self.dtype).removeprefix("torch."),
            device=self.device_info.name,
            async_batching=self.async_batching,
            kernels=self.runner.kernel_tier,
        )
        """What frontends may know of this engine (frozen)."""
        logger.info(
            "engine ready: %s on %s, dtype %s, kernels %s, max_model_len %d, %d KV blocks",
            self.model_source,
            self.device_info.name,
            self.dtype,
            self.runner.kernel_tier,
            self.max_model_len,
            plan.num_blocks,
        )

    # ---- requests -------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"model {self.model_source} has no tokenizer, so text prompts cannot be "
                f"used; pass token ids (a list of ints) instead"
            )
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_only: bool = False,
    ) -> str:
        """Admit a request (n samples when params.n > 1); returns its id. Raises InvalidRequestError.

        By default step() returns the request's output at every step that gives it a token (for streaming);
        with final_only, only once, when it ends (LLM.generate and the benchmarks, which read only the final
        outputs and so skip building every request's output at every step on the host)."""
        self._check_owner("add_request()")
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else self._check_token_ids(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty (0 tokens); give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}, which leaves no "
                f"room for output; shorten the prompt to at most {self.max_model_len - 1} tokens or raise "
                f"max_model_len"
            )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} samples cannot run together: max_num_seqs is "
                f"{self.config.max_num_seqs}; lower n or raise max_num_seqs"
            )
        self._check_vocab(params)
        if params.structured_outputs is not None and self.config.tensor_parallel_size > 1:
            raise InvalidRequestError(
                f"structured output is not supported with tensor_parallel_size="
                f"{self.config.tensor_parallel_size} yet (the workers would sample without "
                f"the grammar's masks); send it to an engine with tensor_parallel_size=1"
            )
        try:
            matchers = self.grammars.matchers(params)
        except InvalidRequestError as exc:  # anything compiling the constraint refuses is about that field
            exc.param = exc.param or "structured_outputs"
            raise
        request_id = request_id if request_id is not None else str(next(self._ids))
        sample_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [i for i in (request_id, *sample_ids) if i in self.outputs.groups or self.scheduler.get(i)]
        if taken:
            raise InvalidRequestError(f"request id {taken[0]!r} is already in use; ids must be unique")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        samples: list[Request] = []
        multi_step = final_only and _plain_greedy(params)
        for i in range(params.n):
            samples.append(
                Request(
                    request_id=sample_ids[i],
                    prompt_token_ids=token_ids,
                    params=params,
                    seed=sample_seed(seed, i),
                    arrival_index=next(self._ids),
                    max_model_len=self.max_model_len,
                    eos_token_ids=self.spec.eos_token_ids,
                    multi_step=multi_step,
                    fork_parent=None if i == 0 else samples[0].request_id,
                )
            )
        for request in samples:
            self.scheduler.add(request)
        self.outputs.track(request_id, text, samples, matchers, final_only)
        return request_id

    def _check_vocab(self, params: SamplingParams) -> None:
        vocab = self.spec.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias)), ("stop_token_ids", list(params.stop_token_ids))):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(
                    f"SamplingParams.{name} has token id {bad[0]}, outside the model's vocabulary [0, {vocab})",
                    param=name,
                )

    def _check_token_ids(self, ids: Sequence[int]) -> list[int]:
        vocab = self.spec.vocab_size
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt token id {t!r} at index {i} is not an integer in [0, {vocab}) "
                    f"(the model's vocabulary size is {vocab})"
                )
            out.append(int(t))
        return out

    def abort(
        self, request_ids: str | Sequence[str], error: str | None = None, error_code: str = "engine_error"
    ) -> list[RequestOutput]:
        """End requests now (all their samples); one terminal output per request that was live. With
        `error`, they failed: the outputs carry it and `error_code` (see RequestOutput.error_code)."""
        self._check_owner("abort()")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            out = None
            for request in self.scheduler.abort(self.outputs.sample_ids(rid), self._newest_in_flight()):
                out = self.outputs.abort(request, error, error_code) or out
            if out is not None:
                outputs.append(out)
        return outputs

    # ---- the loop -------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    def num_waiting(self) -> int:
        """Requests admitted and not yet running (queued, or preempted and waiting to be recomputed)."""
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_generated_tokens(self) -> int:
        """Tokens committed to requests since the engine started (every sample's)."""
        return self.outputs.num_generated_tokens

    def num_unfinished(self) -> int:
        """Requests (samples) admitted and not yet ended."""
        return self.scheduler.num_unfinished

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns outputs of requests that got a token (or finished)."""
        return self._turn(self._advance)

    def drain(self) -> list[RequestOutput]:
        """Finish every step in flight without planning another."""
        return self._turn(self._finish_all)

    def _turn(self, host_turn: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:
        """Run one host turn: here, or, when the executor computes on this thread, on the host thread
        while this thread serves the executor (see runtime/base.py)."""
        self._check_owner("step() or drain()")
        self._turn_running = True
        start = time.perf_counter()
        try:
            lending = self.executor.thread_lending
            if lending is None:
                return host_turn()
            owed = lending.num_queued()  # before the host turn starts submitting
            host = self._host_thread.submit(self._guarded, host_turn)
            try:
                lending.serve(until=host, owed=owed)
            except BaseException:
                self.executor.close()  # fails the queued steps, so the host turn cannot wait for them forever
                raise
            return host.result()
        finally:
            self._active_s += time.perf_counter() - start
            self._turn_running = False

    def _check_owner(self, what: str) -> None:
        """The engine belongs to one thread at a time (see "Threads" above): refuse a call that would
        touch the scheduler while a step's host turn owns it."""
        if self._turn_running:
            raise RuntimeError(
                f"Engine.{what} was called while a step is running (from another thread, or "
                f"from the output sink); call the engine from one thread, between steps"
            )

    def _guarded(self, host_turn: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:
        try:
            return host_turn()
        except BaseException as exc:  # never leave a forward waiting for masks that cannot come
            for handle in self._inflight:
                if handle.grammar is not None:
                    handle.grammar.fail(
                        RuntimeError(
                            f"step {handle.plan.step_id}: the host failed before its "
                            f"grammar masks were ready ({type(exc).__name__})"
                        )
                    )
            raise

    def _advance(self) -> list[RequestOutput]:
        """The step loop, the same for every executor (`depth` steps at most submitted and unfinished):

        1. a full pipeline first finishes its oldest step (with depth 2 it ran during the last call);
        2. steps are planned and submitted until the pipeline is full again; a step planned while
           another is in flight gets placeholders for that step's tokens;
        3. the oldest step is finished now as well when none may stay in flight (depth 1), when no
           step was planned (the pipeline drains), or when it samples a request's first token (the
           overlap must not delay time to first token).
        """
        outputs: list[RequestOutput] = []
        depth = self.executor.depth
        if len(self._inflight) >= depth:
            outputs += self._finish_oldest()
        planned_all = True
        while len(self._inflight) < depth:
            with self.tracer.span("schedule"):
                plan = self.scheduler.schedule(self._newest_in_flight())
            if plan.is_empty:
                planned_all = False
                break
            self._submit(plan)
        if self._inflight and (depth == 1 or not planned_all or self._samples_first_token(self._inflight[0].plan)):
            outputs += self._finish_oldest()
        return outputs

    def _finish_all(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while self._inflight:
            outputs += self._finish_oldest()
        return outputs

    def _submit(self, plan: StepPlan) -> None:
        handle = self.executor.submit(plan)
        self._inflight.append(handle)
        if len(self._inflight) == 1:  # every step before it is committed: its grammar masks can be made now
            self.grammars.fill(plan, handle.prepared, self.outputs, self.tracer)

    def _finish_oldest(self) -> list[RequestOutput]:
        """Wait for the oldest step, release the blocks held for it, commit it; then the next step's
        grammar masks can be made (every token before it is committed now)."""
        handle = self._inflight[0]
        result = self.executor.wait(handle)
        self._inflight.popleft()
        self.blocks.release_held(handle.plan.step_id)
        with self.tracer.span("commit", step=handle.plan.step_id):
            outputs = self.outputs.commit(handle.plan, result, self._newest_in_flight())
        if self._inflight:
            following = self._inflight[0]
            self.grammars.fill(following.plan, following.prepared, self.outputs, self.tracer)
        if self.output_sink is not None and outputs and self.executor.thread_lending is not None:
            self.output_sink(outputs)  # out now, from the host thread, while the forward still runs
            return []
        return outputs

    def _newest_in_flight(self) -> int | None:
        """The step that may still read blocks freed now: frees are held until it finishes."""
        return self._inflight[-1].plan.step_id if self._inflight else None

    def _samples_first_token(self, plan: StepPlan) -> bool:
        for seq in plan.seqs:
            request = self.scheduler.get(seq.request_id) if seq.sampling is not None else None
            if request is not None and request.num_output_tokens == 0:
                return True
        return False

    def close(self) -> None:
        """Finish the step in flight (if any) and stop the executor's worker (and worker processes), even when
        finishing the step fails (a tensor-parallel worker that died)."""
        try:
            self.drain()
        finally:
            self.executor.close()
            self._host_thread.shutdown(wait=True)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (benchmarks run each round from a cold cache)."""
        self.blocks.reset_prefix_cache()

    def start_trace(self) -> None:
        self.tracer.start()

    def save_trace(self, path: str) -> None:
        self.tracer.save(path)

    def stats(self) -> EngineStats:
        s, b = self.scheduler, self.blocks
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_steps=s.stats.num_steps,
            num_preemptions=s.stats.num_preemptions,
            num_partial_prefills=s.stats.num_partial_prefills,
            kv_blocks_total=b.num_blocks,
            kv_blocks_free=b.num_free_blocks,
            kv_blocks_cached=b.num_cached_blocks,
            prefix_hit_tokens=b.prefix_hit_tokens,
            prefix_query_tokens=b.prefix_queries_tokens,
            num_preempted_waiting=sum(1 for r in s.waiting if r.num_preemptions),
            num_generated_tokens=self.outputs.num_generated_tokens,
            num_non_finite=self.outputs.num_non_finite,
            async_batching=self.async_batching,
            device_busy_s=self.executor.device_busy_s,
            active_s=self._active_s,
            step_token_counts=tuple(s.stats.step_tokens.counts),
            step_tokens_total=s.stats.step_tokens.total,
        )

    def check_idle(self) -> None:
        """When no request is left, every block must be free or cached (no leak)."""
        self.blocks.check_invariants()
        if not self.has_work():
            assert self.blocks.num_allocated == 0, f"{self.blocks.num_allocated} KV blocks leaked"
