"""ModelRunner: StepPlan -> tensors -> forward -> sample -> StepResult. Owns weights and KV cache."""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.config import EngineConfig
from conveyor.core.kv_cache import CachePlan
from conveyor.core.persistent_batch import PersistentBatch
from conveyor.core.plan import NONFINITE_TOKEN, PLACEHOLDER_TOKEN, StepPlan, StepResult, TokenLogprobs
from conveyor.device import DeviceInfo, available_memory
from conveyor.errors import ConfigError
from conveyor.host_memory import advise_huge_pages, keep_freed_host_memory
from conveyor.model import kv_int8
from conveyor.model.attention import DECODE_GROUP_SIZE, AttentionBatch, build_attention_batch
from conveyor.model.llama import LlamaModel
from conveyor.model.loader import LoadedModel
from conveyor.model.native import kernel_tier, resolve_kernels
from conveyor.model.sampler import SampleOutput, SamplingKernels, SamplingTensors, plain_greedy, raw_logprobs, sample
from conveyor.model.sampling_inputs import build_sampling_tensors
from conveyor.structured.bitmask import DeferredBitmask

logger = logging.getLogger(__name__)

DEFAULT_CPU_FRACTION = 0.2
DEFAULT_CPU_CAP = 2 * 2**30
DEFAULT_TOKENS_PER_SEQ = 256
"""The default KV cache holds max_num_seqs x this many tokens (a typical chat turn; longer requests
share the cache and are preempted when it runs out), and never less than one max_model_len request."""
DEFAULT_CUDA_FRACTION = 0.8
GRAMMAR_WAIT_S = 600.0
"""Longest wait for a step's grammar masks (the host fills them in milliseconds; this only turns a
bug into an error instead of a hang)."""


def plan_kv_cache(config: EngineConfig, info: DeviceInfo, bytes_per_token: int, max_model_len: int) -> CachePlan:
    """Number of KV blocks from the budget in config.kv_cache_memory (see EngineConfig).

    The default on CPU: room for max(max_num_seqs x DEFAULT_TOKENS_PER_SEQ, max_model_len) tokens, capped
    by DEFAULT_CPU_FRACTION of the available memory and by DEFAULT_CPU_CAP (a 1B-class Llama with 128
    sequences: 1 GiB; the default model: 720 MiB). On CUDA: DEFAULT_CUDA_FRACTION of the free memory,
    capped at what max_num_seqs full-length requests could use."""
    requested = config.kv_cache_memory
    free = available_memory(info)
    if requested is None and info.is_cuda:
        budget = min(int(free * DEFAULT_CUDA_FRACTION), config.max_num_seqs * max_model_len * bytes_per_token)
        text = f"the default ({DEFAULT_CUDA_FRACTION:.0%} of {free / 2**30:.1f} GiB free, capped)"
    elif requested is None:
        tokens = max(config.max_num_seqs * DEFAULT_TOKENS_PER_SEQ, max_model_len)
        budget = min(tokens * bytes_per_token, int(free * DEFAULT_CPU_FRACTION), DEFAULT_CPU_CAP)
        text = (
            f"the default (max(max_num_seqs={config.max_num_seqs} x {DEFAULT_TOKENS_PER_SEQ}, max_model_len="
            f"{max_model_len}) tokens, capped at {DEFAULT_CPU_FRACTION:.0%} of {free / 2**30:.1f} GiB "
            f"available and {DEFAULT_CPU_CAP / 2**30:.0f} GiB)"
        )
    elif isinstance(requested, float):
        budget = int(free * requested)
        text = f"kv_cache_memory={requested} ({requested:.0%} of {free / 2**30:.1f} GiB available)"
    else:
        budget = int(requested)
        text = f"kv_cache_memory={requested}"
    return CachePlan.from_budget(budget, config.block_size, bytes_per_token, max_model_len, text)


@dataclass
class PreparedStep:
    """A plan turned into device tensors (built on the host; on CUDA, copied on the copy stream)."""

    step_id: int
    input_ids: torch.Tensor  # [num_tokens] int64, PLACEHOLDER_TOKEN where the previous step fills in
    positions: torch.Tensor  # [num_tokens] int64
    batch: AttentionBatch | None  # None when no sequence computes tokens
    sample_rows: torch.Tensor | None  # [num_sampled] int64 rows of the flattened batch
    sampling: SamplingTensors | None
    placeholder_positions: torch.Tensor | None  # [num_placeholders] rows of input_ids
    placeholder_sources: torch.Tensor | None  # [num_placeholders] rows of the previous step's sampled ids
    history_holes: torch.Tensor | None  # [holes] positions in sampling.penalties.tokens
    history_sources: torch.Tensor | None  # [holes] rows of the previous step's sampled ids
    source_step_id: int | None
    copy_from: torch.Tensor | None  # [copies] blocks to copy (copy-on-write) ...
    copy_to: torch.Tensor | None  # [copies] ... into these
    prompt_rows: torch.Tensor | None  # [prompt_rows] rows whose next-token logprobs are asked
    prompt_targets: torch.Tensor | None  # [prompt_rows] the next prompt token of each
    prompt_top_n: int = 0
    samples_every_row: bool = False
    """sample_rows is every row in order (a pure decode step's): the forward samples from the hidden states as
    they are, without gathering them."""
    grammar: DeferredBitmask | None = None
    """Grammar masks of the constrained sampled rows; the engine fills them once the tokens before
    them are committed (under async batching: while this step's forward already runs)."""
    later: LaterSteps | None = None
    """A multi-step plan's steps after the first (StepPlan.num_steps > 1), else None."""
    ready: Any = None
    """CUDA event recorded after the host-to-device copies (None on CPU)."""


@dataclass
class LaterSteps:
    """The inputs of a multi-step plan's steps 2..n, whose tokens are the step before's samples: step j (from 0)
    reads row j - 1 of each tensor. Every row of the plan is a decode that samples, in batch order."""

    positions: torch.Tensor  # [n - 1, rows] int64
    slot_mapping: torch.Tensor  # [n - 1, rows] int64
    context_lens: list[torch.Tensor]  # per decode group: [n - 1, group] int64

    def apply(self, j: int, batch: AttentionBatch) -> torch.Tensor:
        """Point `batch` at step j's slots and context lengths (masks built for another step dropped); returns
        step j's positions [rows]."""
        batch.slot_mapping = self.slot_mapping[j - 1]
        for group, lens in zip(batch.decode_groups, self.context_lens):
            group.context_lens = lens[j - 1]
            group.mask = None
            group.window_masks.clear()
        return self.positions[j - 1]


@dataclass
class StepOutput:
    """Device tensors of one step, before they come back to the host. The sampled ids here are the ones the host
    receives: NONFINITE_TOKEN where a row's logits were not finite (see reported)."""

    sample: SampleOutput | None
    prompt: SampleOutput | None
    later: list[torch.Tensor] | None = None
    """A multi-step plan: the sampled ids [rows] of its steps 2..n."""


def reported(out: SampleOutput) -> SampleOutput:
    """The samples as the host receives them: NONFINITE_TOKEN in each row whose logits were not finite (the engine
    ends that request with an error), in the same tensor as the ids, so the check adds no transfer and no sync. The
    next step's placeholders are filled from the ids as sampled (valid ids always), never from these."""
    if out.finite is None:
        return out
    ids = torch.where(out.finite, out.tokens, NONFINITE_TOKEN)  # [rows]
    return dataclasses.replace(out, tokens=ids, finite=None)


class ModelRunner:
    """The only code that touches the device: weights, KV cache, forward and sampling."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int, info: DeviceInfo) -> None:
        self.config = config
        self.spec = loaded.spec
        self.info = info
        self.device = info.device
        self.block_size = config.block_size
        if config.quantization is not None and info.device.type != "cpu":
            raise ConfigError(
                f"quantization={config.quantization!r} has CPU kernels only and cannot run on {info.name}; "
                f"use device='cpu', or leave quantization unset (dtype='bfloat16' is fast on GPUs)"
            )
        kernels = resolve_kernels(config.kernels, info.device)
        self.model = LlamaModel(
            loaded.spec, loaded.weights, max_model_len, info.device, config.quantization, kernels, config.gguf_weights
        )
        self.decode_group_size = DECODE_GROUP_SIZE if kernels is None else 2**31
        """Decodes per attention group: the torch path pads each group to its longest context; the
        native kernel pads nothing and takes them all at once."""
        self.kernel_tier = kernel_tier() if kernels is not None else "torch"
        """The native kernels' ISA tier (conveyor/model/isa.py), or 'torch' where torch's ops run."""
        self.sampling_kernels: SamplingKernels | None = kernels
        """The sampler's argmax and structured output's grammar masks by the native kernels (None: torch's ops)."""
        loaded.weights.clear()  # the model holds its own (device) copies now
        if config.kv_cache_dtype == "int8" and info.device.type != "cpu":
            raise ConfigError(
                f"kv_cache_dtype='int8' runs on CPU only for now, not on {info.name}; use device='cpu', "
                f"or leave kv_cache_dtype at 'auto'"
            )
        self.cache_dtype = torch.int8 if config.kv_cache_dtype == "int8" else self.model.dtype
        spec = self.spec
        if self.cache_dtype == torch.int8:
            bytes_per_token = kv_int8.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim)
        else:
            bytes_per_token = spec.kv_bytes_per_token(torch.empty((), dtype=self.model.dtype).element_size())
        self.cache_plan = plan_kv_cache(config, info, bytes_per_token, max_model_len)
        shape: tuple[int, ...]
        if self.cache_dtype == torch.int8:  # each [num_blocks, kv_heads, block_size * (head_dim + 4)] int8 pages
            shape = kv_int8.cache_shape(self.cache_plan.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        else:  # each [num_blocks, block_size, kv_heads, head_dim]
            shape = (self.cache_plan.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [(self._new_cache(shape), self._new_cache(shape)) for _ in range(spec.num_layers)]
        if not info.is_cuda:
            keep_freed_host_memory()  # activations live in host memory: reuse freed blocks (conveyor/host_memory.py)
        self.copy_stream = torch.cuda.Stream(self.device) if info.is_cuda else None
        self.compute_stream = torch.cuda.Stream(self.device) if info.is_cuda else None
        if info.is_cuda:
            torch.cuda.synchronize(self.device)  # weights and cache exist before other streams use them
        self._moved: list[torch.Tensor] = []
        self.batch = PersistentBatch()
        """Block tables and penalty histories of the running requests, kept across steps from the plans' deltas."""
        self._last_sampled: torch.Tensor | None = None  # [num_sampled] ids of the newest step run
        self._last_step_id: int | None = None
        self.num_placeholder_tokens = 0
        """Input tokens filled on the device from the previous step's samples (async batching at work)."""
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB, %s)",
            self.cache_plan.num_blocks,
            self.block_size,
            self.cache_plan.num_blocks * self.cache_plan.bytes_per_block / 2**20,
            "int8" if self.cache_dtype == torch.int8 else str(self.cache_dtype).removeprefix("torch."),
        )

    def _new_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's K or V cache, zero-filled so that masked-out slots never hold NaN/inf garbage; in host
        memory, on huge pages where Linux grants them (conveyor/host_memory.py)."""
        cache = torch.empty(shape, dtype=self.cache_dtype, device=self.device)
        if not self.info.is_cuda:
            advise_huge_pages(cache.data_ptr(), cache.numel() * cache.element_size())
        return cache.zero_()

    # ---- host side --------------------------------------------------------------------
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if not self.info.is_cuda:
            return t
        moved = t.pin_memory().to(self.device, non_blocking=True)  # pinned blocks are reused by torch's host cache
        self._moved.append(moved)
        return moved

    def prepare(self, plan: StepPlan, previous: StepPlan | None = None) -> PreparedStep:
        """Build the step's tensors. `previous` is the plan still in flight, whose sampled ids
        fill this plan's placeholder tokens on the device."""
        self._moved = []
        stream_ctx = torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else nullcontext()
        with stream_ctx:
            prepared = self._prepare(plan, previous)
            if self.copy_stream is not None:
                prepared.ready = torch.cuda.Event()
                prepared.ready.record(self.copy_stream)
        if self.compute_stream is not None:  # the compute stream uses them next: keep their memory until then
            for moved in self._moved:
                moved.record_stream(self.compute_stream)
        self._moved = []
        return prepared

    def _prepare(self, plan: StepPlan, previous: StepPlan | None) -> PreparedStep:
        self.batch.apply(plan)
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        holes: list[int] = []
        sources: list[int] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        last_row: dict[str, int] = {}
        source_row = {s.request_id: i for i, s in enumerate(previous.sampling_seqs)} if previous else {}
        for s in plan.seqs:
            for j, token in enumerate(s.input_token_ids):
                if token == PLACEHOLDER_TOKEN:
                    if s.request_id not in source_row:
                        raise RuntimeError(
                            f"step {plan.step_id}: request {s.request_id!r} has a placeholder "
                            f"token but the in-flight step does not sample it"
                        )
                    holes.append(len(ids) + j)
                    sources.append(source_row[s.request_id])
            if s.prompt_logprob_targets is not None:
                for j, target in enumerate(s.prompt_logprob_targets):
                    if target >= 0:
                        prompt_rows.append(len(ids) + j)
                        prompt_targets.append(target)
            ids.extend(s.input_token_ids)
            positions.extend(range(s.start_position, s.context_len))
            if s.num_tokens:
                last_row[s.request_id] = len(ids) - 1
            if s.sampling is not None:
                sample_rows.append(last_row[s.sample_from or s.request_id])
        self.num_placeholder_tokens += len(holes)
        t = self._to_device
        computing = [s for s in plan.seqs if s.num_tokens]
        sampling_seqs = plan.sampling_seqs
        history_holes: list[int] = []
        history_sources: list[int] = []
        sampling = None
        if sampling_seqs:
            sampling = build_sampling_tensors(
                [s.sampling for s in sampling_seqs if s.sampling is not None],
                t,
                history_holes,
                history_sources,
                source_row,
                [s.request_id for s in sampling_seqs],
                self.batch.history,
            )
        uses_previous = bool(holes or history_holes)

        def index(values: list[int]) -> torch.Tensor | None:
            return t(torch.tensor(values, dtype=torch.int64)) if values else None

        batch = (
            build_attention_batch(
                [s.start_position for s in computing],
                [s.num_tokens for s in computing],
                [self.batch.block_table(s.request_id) for s in computing],
                self.block_size,
                t,
                self.decode_group_size,
                plan.num_steps - 1,
            )
            if computing
            else None
        )
        every_row = sample_rows == list(range(len(ids)))
        later = None
        if plan.num_steps > 1:
            if batch is None or not every_row or len(ids) != len(plan.seqs):
                raise RuntimeError(
                    f"step {plan.step_id}: a plan of {plan.num_steps} steps must be decodes that each "
                    f"sample, one row per sequence"
                )
            later = self._later_steps(plan, batch)
        return PreparedStep(
            step_id=plan.step_id,
            input_ids=t(torch.tensor(ids, dtype=torch.int64)),
            positions=t(torch.tensor(positions, dtype=torch.int64)),
            batch=batch,
            sample_rows=index(sample_rows),
            sampling=sampling,
            placeholder_positions=index(holes),
            placeholder_sources=index(sources),
            history_holes=index(history_holes),
            history_sources=index(history_sources),
            source_step_id=previous.step_id if uses_previous and previous else None,
            copy_from=index([a for a, _ in plan.block_copies]),
            copy_to=index([b for _, b in plan.block_copies]),
            prompt_rows=index(prompt_rows),
            prompt_targets=index(prompt_targets),
            prompt_top_n=max((s.num_prompt_logprobs for s in plan.seqs), default=0),
            samples_every_row=every_row,
            grammar=_deferred_bitmask(sampling_seqs),
            later=later,
        )

    def _later_steps(self, plan: StepPlan, batch: AttentionBatch) -> LaterSteps:
        """Positions, slots and context lengths of steps 2..n of a multi-step plan (the scheduler allocated their
        blocks: the runner's tables hold them)."""
        bs, steps = self.block_size, plan.num_steps
        positions: list[int] = []
        slots: list[int] = []
        for j in range(1, steps):
            for s in plan.seqs:
                table, pos = self.batch.block_table(s.request_id), s.start_position + j
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
        ahead = torch.arange(1, steps, dtype=torch.int64).unsqueeze(1)  # [n - 1, 1]
        t = self._to_device
        rows = len(plan.seqs)
        return LaterSteps(
            positions=t(torch.tensor(positions, dtype=torch.int64).view(steps - 1, rows)),
            slot_mapping=t(torch.tensor(slots, dtype=torch.int64).view(steps - 1, rows)),
            context_lens=[
                group.context_lens.unsqueeze(0) + ahead.to(group.context_lens.device) for group in batch.decode_groups
            ],
        )

    # ---- device side ------------------------------------------------------------------
    def forward(self, step: PreparedStep) -> StepOutput:
        """Run one prepared step; returns device tensors (no sync). On CUDA it runs on the
        compute stream, after the step's host-to-device copies."""
        if self.compute_stream is None:
            return self._forward(step)
        with torch.cuda.stream(self.compute_stream):
            self.compute_stream.wait_event(step.ready)
            return self._forward(step)

    def _previous_samples(self, step: PreparedStep) -> torch.Tensor:
        if step.source_step_id != self._last_step_id or self._last_sampled is None:
            raise RuntimeError(
                f"step {step.step_id} needs tokens of step {step.source_step_id}, but the last "
                f"step run was {self._last_step_id}"
            )
        return self._last_sampled

    @torch.inference_mode()
    def _forward(self, step: PreparedStep) -> StepOutput:
        if step.copy_from is not None and step.copy_to is not None:
            for k_cache, v_cache in self.kv_caches:  # copy-on-write of shared blocks
                k_cache.index_copy_(0, step.copy_to, k_cache[step.copy_from])
                v_cache.index_copy_(0, step.copy_to, v_cache[step.copy_from])
        input_ids = step.input_ids
        if step.placeholder_positions is not None and step.placeholder_sources is not None:
            filled = self._previous_samples(step)[step.placeholder_sources]  # [num_placeholders]
            input_ids = input_ids.index_put((step.placeholder_positions,), filled)  # [num_tokens]
        if (
            step.history_holes is not None
            and step.history_sources is not None
            and step.sampling is not None
            and step.sampling.penalties is not None
        ):
            p = step.sampling.penalties
            p.tokens = p.tokens.index_put((step.history_holes,), self._previous_samples(step)[step.history_sources])
        hidden = None
        if step.batch is not None:
            hidden = self.model.forward(input_ids, step.positions, step.batch, self.kv_caches)  # [num_tokens, hidden]
        sample_out = prompt_out = None
        if hidden is not None and step.sample_rows is not None and step.sampling is not None:
            sampled_hidden = hidden if step.samples_every_row else hidden[step.sample_rows]  # [num_sampled, hidden]
            sample_out = self._sample(step, sampled_hidden)
        if hidden is not None and step.prompt_rows is not None and step.prompt_targets is not None:
            logits = self.model.logits(hidden[step.prompt_rows])  # [prompt_rows, vocab]
            prompt_out = raw_logprobs(logits, step.prompt_targets, step.prompt_top_n)
        later: list[torch.Tensor] | None = None
        tokens = None if sample_out is None else sample_out.tokens  # [rows]: the next step's inputs
        if step.later is not None and step.batch is not None and tokens is not None:
            later = []
            for j in range(1, len(step.later.positions) + 1):
                positions = step.later.apply(j, step.batch)  # [rows]
                hidden = self.model.forward(tokens, positions, step.batch, self.kv_caches)  # [rows, hidden]
                out = self._sample(step, hidden)
                tokens = out.tokens
                later.append(reported(out).tokens)
        self._last_sampled = tokens
        self._last_step_id = step.step_id
        return StepOutput(None if sample_out is None else reported(sample_out), prompt_out, later)

    def _sample(self, step: PreparedStep, sampled_hidden: torch.Tensor) -> SampleOutput:
        """sampled_hidden [num_sampled, hidden] -> the step's samples: the argmax from the LM head's product where
        every row is plain greedy (no logits written), else logits and the sampler."""
        fused = (
            self.model.greedy_tokens(sampled_hidden)
            if step.grammar is None and step.sampling is not None and plain_greedy(step.sampling)
            else None
        )
        if fused is not None:  # [num_sampled] ids, [num_sampled] finite
            return SampleOutput(fused[0], finite=fused[1])
        assert step.sampling is not None
        logits = self.model.logits(sampled_hidden)  # [num_sampled, vocab]
        return sample(logits, step.sampling, self._grammar_mask(step), self.sampling_kernels, logits_owned=True)

    def _grammar_mask(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [k] int64, bitmask [k, words] int32) on the device; waits for the host to fill it."""
        if step.grammar is None:
            return None
        bitmask = step.grammar.wait(timeout_s=GRAMMAR_WAIT_S)
        rows = torch.tensor(step.grammar.rows, dtype=torch.int64)
        if self.info.is_cuda:
            return rows.to(self.device, non_blocking=True), bitmask.to(self.device, non_blocking=True)
        return rows, bitmask

    def fetch(self, plan: StepPlan, out: StepOutput) -> StepResult:
        """Bring a step's output to the host (the synchronous path's one sync)."""
        if self.compute_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.compute_stream)
        return to_result(plan, out)


def _deferred_bitmask(sampling_seqs: list[Any]) -> DeferredBitmask | None:
    rows = [i for i, s in enumerate(sampling_seqs) if s.sampling is not None and s.sampling.constrained]
    return DeferredBitmask(rows) if rows else None


def _logprob_rows(out: SampleOutput) -> list[TokenLogprobs]:
    ids = out.tokens.tolist()
    chosen = out.logprob.tolist() if out.logprob is not None else []
    ranks = out.rank.tolist() if out.rank is not None else []
    top_ids = out.top_ids.tolist() if out.top_ids is not None else [[] for _ in ids]
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in ids]
    return [
        TokenLogprobs(t, lp, r, list(zip(ti, tl))) for t, lp, r, ti, tl in zip(ids, chosen, ranks, top_ids, top_lps)
    ]


def to_result(plan: StepPlan, out: StepOutput) -> StepResult:
    """Device tensors -> plain lists (the one sync of a step), trimmed to what each request asked."""
    sampled: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    if out.sample is not None:
        sampled = out.sample.tokens.tolist()
        if out.sample.logprob is not None:
            rows = _logprob_rows(out.sample)
            for seq, row in zip(plan.sampling_seqs, rows):
                n = seq.sampling.logprobs if seq.sampling is not None else None
                logprobs.append(None if n is None else TokenLogprobs(row.token_id, row.logprob, row.rank, row.top[:n]))
    prompt: dict[str, list[TokenLogprobs | None]] = {}
    if out.prompt is not None:
        prompt_rows = iter(_logprob_rows(out.prompt))
        for seq in plan.seqs:
            if seq.prompt_logprob_targets is None:
                continue
            prompt[seq.request_id] = [
                None if target < 0 else _trim(next(prompt_rows), seq.num_prompt_logprobs)
                for target in seq.prompt_logprob_targets
            ]
    later = [tokens.tolist() for tokens in out.later] if out.later else []
    return StepResult(plan.step_id, sampled, logprobs, prompt, later)


def _trim(row: TokenLogprobs, n: int) -> TokenLogprobs:
    return TokenLogprobs(row.token_id, row.logprob, row.rank, row.top[:n])
