"""ModelRunner: StepPlan -> tensors -> forward -> sample -> StepResult. Owns weights and KV cache."""

from __future__ import annotations

import logging

import torch

from conveyor.config import EngineConfig
from conveyor.core.kv_cache import CachePlan
from conveyor.core.plan import StepPlan, StepResult
from conveyor.model.attention import build_attention_batch
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


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int, info: DeviceInfo) -> None:
        self.config = config
        self.spec = loaded.spec
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
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", self.cache_plan.num_blocks, self.block_size,
                    self.cache_plan.num_blocks * self.cache_plan.bytes_per_block / 2**20)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        if plan.is_empty:
            return StepResult(plan.step_id, [])
        seqs = plan.seqs
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for s in seqs:
            ids.extend(s.input_token_ids)
            positions.extend(range(s.start_position, s.context_len))
            if s.sampling is not None:
                sample_rows.append(len(ids) - 1)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)  # [num_tokens]
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)  # [num_tokens]
        batch = build_attention_batch([s.start_position for s in seqs], [s.num_tokens for s in seqs],
                                      [s.block_table for s in seqs], self.block_size, dev)
        hidden = self.model.forward(input_ids, pos, batch, self.kv_caches)  # [num_tokens, hidden]
        if not sample_rows:
            return StepResult(plan.step_id, [])
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=dev)  # [num_sampled]
        logits = self.model.logits(hidden[rows])  # [num_sampled, vocab]
        tokens = sample(logits, self._sampling_tensors(plan))  # [num_sampled]
        return StepResult(plan.step_id, tokens.tolist())

    def _sampling_tensors(self, plan: StepPlan) -> SamplingTensors:
        specs = [s.sampling for s in plan.seqs if s.sampling is not None]
        dev = self.device
        temps = [sp.temperature for sp in specs]
        top_k = [sp.top_k for sp in specs]
        top_p = [sp.top_p for sp in specs]
        return SamplingTensors(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=dev),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev),
            seeds=torch.tensor([sp.seed for sp in specs], dtype=torch.int64, device=dev),
            output_index=torch.tensor([sp.output_index for sp in specs], dtype=torch.int64, device=dev),
            all_greedy=all(t == 0 for t in temps),
            any_top_k_or_p=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p))
