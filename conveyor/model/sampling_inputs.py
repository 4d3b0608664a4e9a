"""Plain per-row SamplingSpecs -> the sampler's batched tensors (built on the host)."""

from __future__ import annotations

from typing import Callable

import torch

from conveyor.core.plan import PLACEHOLDER_TOKEN, SamplingSpec
from conveyor.model.sampler import PenaltyTensors, SamplingTensors

ToDevice = Callable[[torch.Tensor], torch.Tensor]


def build_sampling_tensors(specs: list[SamplingSpec], to_device: ToDevice,
                           history_holes: list[int], history_sources: list[int],
                           source_row: dict[str, int], request_ids: list[str],
                           known_history: Callable[[str], list[int]]) -> SamplingTensors:
    """`known_history(request_id)`: the known ids of a row with penalties (PersistentBatch.history); its
    in-flight ids follow as placeholders. `history_holes` / `history_sources` are filled in (flattened-history
    position, row of the previous step's samples) for those placeholders."""
    temps = [s.temperature for s in specs]
    top_k = [s.top_k for s in specs]
    top_p = [s.top_p for s in specs]
    min_p = [s.min_p for s in specs]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype))

    bias = None
    bias_rows = [i for i, s in enumerate(specs) for _ in s.logit_bias]
    if bias_rows:
        bias = (tensor(bias_rows, torch.int64), tensor([t for s in specs for t, _ in s.logit_bias], torch.int64),
                tensor([v for s in specs for _, v in s.logit_bias], torch.float32))
    suppress = None
    suppress_rows = [i for i, s in enumerate(specs) for _ in s.suppress_token_ids]
    if suppress_rows:
        suppress = (tensor(suppress_rows, torch.int64),
                    tensor([t for s in specs for t in s.suppress_token_ids], torch.int64))
    penalties = None
    if any(s.has_penalties for s in specs):
        rows: list[int] = []
        tokens: list[int] = []
        is_output: list[bool] = []
        for i, (s, rid) in enumerate(zip(specs, request_ids)):
            if s.history_tail is None:
                continue
            known = known_history(rid)
            length = len(known) + s.num_history_placeholders
            if s.num_history_placeholders:
                if rid not in source_row:
                    raise RuntimeError(f"request {rid!r}: penalty history has an in-flight token the "
                                       f"previous step did not sample")
                holes = range(len(tokens) + len(known), len(tokens) + length)
                history_holes.extend(holes)
                history_sources.extend([source_row[rid]] * len(holes))
            tokens.extend(known)
            tokens.extend([PLACEHOLDER_TOKEN] * s.num_history_placeholders)
            rows.extend([i] * length)
            num_prompt = min(s.num_prompt_tokens, length)
            is_output.extend([False] * num_prompt)
            is_output.extend([True] * (length - num_prompt))
        penalties = PenaltyTensors(
            rows=tensor(rows, torch.int64), tokens=tensor(tokens, torch.int64), is_output=tensor(is_output, torch.bool),
            presence=tensor([s.presence_penalty for s in specs], torch.float32),
            frequency=tensor([s.frequency_penalty for s in specs], torch.float32),
            repetition=tensor([s.repetition_penalty for s in specs], torch.float32))
    wanted = [s.logprobs for s in specs if s.logprobs is not None]
    return SamplingTensors(
        temperature=tensor(temps, torch.float32), top_k=tensor(top_k, torch.int64),
        top_p=tensor(top_p, torch.float32), min_p=tensor(min_p, torch.float32) if any(min_p) else None,
        seeds=tensor([s.seed for s in specs], torch.int64),
        output_index=tensor([s.output_index for s in specs], torch.int64),
        all_greedy=all(x == 0 for x in temps),
        any_top_k_or_p=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
        bias=bias, suppress=suppress, penalties=penalties,
        num_logprobs=max(wanted) if wanted else None)
