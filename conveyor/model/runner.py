"""ModelRunner: StepPlan -> tensors -> forward -> sample -> StepResult. Owns weights and KV cache."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.config import EngineConfig
from conveyor.core.kv_cache import CachePlan
from conveyor.core.plan import PLACEHOLDER_TOKEN, StepPlan, StepResult
from conveyor.model.attention import AttentionBatch, build_attention_batch
from conveyor.model.llama import LlamaModel
from conveyor.model.loader import LoadedModel
from conveyor.model.sampler import SamplingTensors, sample
from conveyor.runtime.device import DeviceInfo, available_memory

logger = logging.getLogger(__name__)

DEFAULT_CPU_FRACTION = 0.2
DEFAULT_CPU_CAP = 2 * 2**30
DEFAULT_CUDA_FRACTION = 0.8


def plan_kv_cache(config: EngineConfig, info: DeviceInfo, bytes_per_token: int, max_model_len: int) -> CachePlan:
    """Number of KV blocks from the budget in config.kv_cache_memory (see EngineConfig)."""
    requested = config.kv_cache_memory
    free = available_memory(info)
    if requested is None:
        fraction = DEFAULT_CUDA_FRACTION if info.is_cuda else DEFAULT_CPU_FRACTION
        budget = int(free * fraction)
        useful = config.max_num_seqs * max_model_len * bytes_per_token
        budget = min(budget, useful) if info.is_cuda else min(budget, useful, DEFAULT_CPU_CAP)
        text = f"the default ({fraction:.0%} of {free / 2**30:.1f} GiB available, capped)"
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
    batch: AttentionBatch
    sample_rows: torch.Tensor | None  # [num_sampled] int64 rows of the flattened batch
    sampling: SamplingTensors | None
    placeholder_positions: torch.Tensor | None  # [num_placeholders] rows of input_ids
    placeholder_sources: torch.Tensor | None  # [num_placeholders] rows of the previous step's sampled ids
    source_step_id: int | None
    ready: Any = None
    """CUDA event recorded after the host-to-device copies (None on CPU)."""


class ModelRunner:
    """The only code that touches the device: weights, KV cache, forward and sampling."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int, info: DeviceInfo) -> None:
        self.config = config
        self.spec = loaded.spec
        self.info = info
        self.device = info.device
        self.block_size = config.block_size
        self.model = LlamaModel(loaded.spec, loaded.weights, max_model_len, info.device)
        loaded.weights.clear()  # the model holds its own (device) copies now
        element = torch.empty((), dtype=self.model.dtype).element_size()
        self.cache_plan = plan_kv_cache(config, info, self.spec.kv_bytes_per_token(element), max_model_len)
        shape = (self.cache_plan.num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        # Zero-filled so that masked-out slots never hold NaN/inf garbage.
        self.kv_caches = [(torch.zeros(shape, dtype=self.model.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.model.dtype, device=self.device))
                          for _ in range(self.spec.num_layers)]  # each [num_blocks, block_size, kv_heads, head_dim]
        self.copy_stream = torch.cuda.Stream(self.device) if info.is_cuda else None
        self.compute_stream = torch.cuda.Stream(self.device) if info.is_cuda else None
        if info.is_cuda:
            torch.cuda.synchronize(self.device)  # weights and cache exist before other streams use them
        self._last_sampled: torch.Tensor | None = None  # [num_sampled] ids of the newest step run
        self._last_step_id: int | None = None
        self.num_placeholder_tokens = 0
        """Input tokens filled on the device from the previous step's samples (async batching at work)."""
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", self.cache_plan.num_blocks, self.block_size,
                    self.cache_plan.num_blocks * self.cache_plan.bytes_per_block / 2**20)

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
        self._moved: list[torch.Tensor] = []
        stream_ctx = torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else nullcontext()
        with stream_ctx:
            ids: list[int] = []
            positions: list[int] = []
            sample_rows: list[int] = []
            holes: list[int] = []
            sources: list[int] = []
            source_row = {s.request_id: i for i, s in enumerate(previous.sampling_seqs)} if previous else {}
            for s in plan.seqs:
                for j, token in enumerate(s.input_token_ids):
                    if token == PLACEHOLDER_TOKEN:
                        if s.request_id not in source_row:
                            raise RuntimeError(f"step {plan.step_id}: request {s.request_id!r} has a placeholder "
                                               f"token but the in-flight step does not sample it")
                        holes.append(len(ids) + j)
                        sources.append(source_row[s.request_id])
                ids.extend(s.input_token_ids)
                positions.extend(range(s.start_position, s.context_len))
                if s.sampling is not None:
                    sample_rows.append(len(ids) - 1)
            self.num_placeholder_tokens += len(holes)
            t = self._to_device
            prepared = PreparedStep(
                step_id=plan.step_id,
                input_ids=t(torch.tensor(ids, dtype=torch.int64)),
                positions=t(torch.tensor(positions, dtype=torch.int64)),
                batch=build_attention_batch([s.start_position for s in plan.seqs], [s.num_tokens for s in plan.seqs],
                                            [s.block_table for s in plan.seqs], self.block_size, t),
                sample_rows=t(torch.tensor(sample_rows, dtype=torch.int64)) if sample_rows else None,
                sampling=self._sampling_tensors(plan) if sample_rows else None,
                placeholder_positions=t(torch.tensor(holes, dtype=torch.int64)) if holes else None,
                placeholder_sources=t(torch.tensor(sources, dtype=torch.int64)) if holes else None,
                source_step_id=previous.step_id if holes and previous else None)
            if self.copy_stream is not None:
                prepared.ready = torch.cuda.Event()
                prepared.ready.record(self.copy_stream)
        if self.compute_stream is not None:  # the compute stream uses them next: keep their memory until then
            for moved in self._moved:
                moved.record_stream(self.compute_stream)
        self._moved = []
        return prepared

    def _sampling_tensors(self, plan: StepPlan) -> SamplingTensors:
        specs = [s.sampling for s in plan.seqs if s.sampling is not None]
        temps = [sp.temperature for sp in specs]
        top_k = [sp.top_k for sp in specs]
        top_p = [sp.top_p for sp in specs]
        t = self._to_device
        return SamplingTensors(
            temperature=t(torch.tensor(temps, dtype=torch.float32)),
            top_k=t(torch.tensor(top_k, dtype=torch.int64)),
            top_p=t(torch.tensor(top_p, dtype=torch.float32)),
            seeds=t(torch.tensor([sp.seed for sp in specs], dtype=torch.int64)),
            output_index=t(torch.tensor([sp.output_index for sp in specs], dtype=torch.int64)),
            all_greedy=all(x == 0 for x in temps),
            any_top_k_or_p=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p))

    # ---- device side ------------------------------------------------------------------
    def forward(self, step: PreparedStep) -> torch.Tensor | None:
        """Run one prepared step; returns the sampled ids [num_sampled] on the device (no sync).
        On CUDA it runs on the compute stream, after the step's host-to-device copies."""
        if self.compute_stream is None:
            return self._forward(step)
        with torch.cuda.stream(self.compute_stream):
            self.compute_stream.wait_event(step.ready)
            return self._forward(step)

    @torch.inference_mode()
    def _forward(self, step: PreparedStep) -> torch.Tensor | None:
        input_ids = step.input_ids
        if step.placeholder_positions is not None:
            if step.source_step_id != self._last_step_id or self._last_sampled is None:
                raise RuntimeError(f"step {step.step_id} needs tokens of step {step.source_step_id}, but the last "
                                   f"step run was {self._last_step_id}")
            input_ids = input_ids.index_put((step.placeholder_positions,),
                                            self._last_sampled[step.placeholder_sources])  # [num_tokens]
        hidden = self.model.forward(input_ids, step.positions, step.batch, self.kv_caches)  # [num_tokens, hidden]
        tokens = None
        if step.sample_rows is not None and step.sampling is not None:
            logits = self.model.logits(hidden[step.sample_rows])  # [num_sampled, vocab]
            tokens = sample(logits, step.sampling)  # [num_sampled]
        self._last_sampled, self._last_step_id = tokens, step.step_id
        return tokens

    def execute(self, plan: StepPlan) -> StepResult:
        """Prepare, run and fetch in one go (the synchronous path)."""
        tokens = self.forward(self.prepare(plan))
        return StepResult(plan.step_id, [] if tokens is None else tokens.tolist())
