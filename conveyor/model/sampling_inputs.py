"""Plain per-row SamplingSpecs -> the sampler's batched tensors (built on the host)."""

from __future__ import annotations

from array import array
from collections.abc import Callable

import numpy as np
import torch

from conveyor.core.plan import PLACEHOLDER_TOKEN, SamplingSpec
from conveyor.model.sampler import PenaltyTensors, SamplingTensors

ToDevice = Callable[[torch.Tensor], torch.Tensor]


TOP_K_ALL = 2**31 - 1
"""A top_k past every vocabulary (it keeps every token); larger ones are taken as this one, so that any integer a
request may give fits the step's int64 tensor."""


def build_sampling_tensors(
    specs: list[SamplingSpec],
    to_device: ToDevice,
    history_holes: list[int],
    history_sources: list[int],
    source_row: dict[str, int],
    request_ids: list[str],
    known_history: Callable[[str], array[int]],
) -> SamplingTensors:
    """`known_history(request_id)`: the known ids of a row with penalties (PersistentBatch.history); its
    in-flight ids follow as placeholders. `history_holes` / `history_sources` are filled in (flattened-history
    position, row of the previous step's samples) for those placeholders."""
    temps = [s.temperature for s in specs]
    top_k = [min(s.top_k, TOP_K_ALL) for s in specs]
    top_p = [s.top_p for s in specs]
    min_p = [s.min_p for s in specs]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype))

    bias = None
    bias_rows = [i for i, s in enumerate(specs) for _ in s.logit_bias]
    if bias_rows:
        bias = (
            tensor(bias_rows, torch.int64),
            tensor([t for s in specs for t, _ in s.logit_bias], torch.int64),
            tensor([v for s in specs for _, v in s.logit_bias], torch.float32),
        )
    suppress = None
    suppress_rows = [i for i, s in enumerate(specs) for _ in s.suppress_token_ids]
    if suppress_rows:
        suppress = (
            tensor(suppress_rows, torch.int64),
            tensor([t for s in specs for t in s.suppress_token_ids], torch.int64),
        )
    penalties = None
    if any(s.has_penalties for s in specs):
        penalties = _penalty_tensors(
            specs, request_ids, known_history, history_holes, history_sources, source_row, to_device
        )
    wanted = [s.logprobs for s in specs if s.logprobs is not None]
    all_greedy = all(x == 0 for x in temps)
    random = not all_greedy  # the random rows' tensors, built only where a row samples (see SamplingTensors)
    return SamplingTensors(
        temperature=tensor(temps, torch.float32) if random else None,
        top_k=tensor(top_k, torch.int64) if random else None,
        top_p=tensor(top_p, torch.float32) if random else None,
        min_p=tensor(min_p, torch.float32) if random and any(min_p) else None,
        seeds=tensor([s.seed for s in specs], torch.int64) if random else None,
        output_index=tensor([s.output_index for s in specs], torch.int64) if random else None,
        all_greedy=all_greedy,
        any_top_k_or_p=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
        bias=bias,
        suppress=suppress,
        penalties=penalties,
        num_logprobs=max(wanted) if wanted else None,
    )


def _penalty_tensors(
    specs: list[SamplingSpec],
    request_ids: list[str],
    known_history: Callable[[str], array[int]],
    history_holes: list[int],
    history_sources: list[int],
    source_row: dict[str, int],
    to_device: ToDevice,
) -> PenaltyTensors:
    """The penalty rows' histories flattened with a handful of numpy ops (no Python loop over token ids, and
    numpy's single thread keeps the host out of torch's thread pool while a forward runs): each row's known
    ids, read in place from the persistent batch, then its in-flight placeholders."""
    parts: list[np.ndarray] = []
    rows: list[int] = []
    lengths: list[int] = []
    num_prompt: list[int] = []
    total = 0
    for i, (s, rid) in enumerate(zip(specs, request_ids)):
        if s.history_tail is None:
            continue
        known = known_history(rid)
        parts.append(np.frombuffer(known, dtype=np.int64))  # [len(known)] a view, copied by concatenate below
        if s.num_history_placeholders:
            if rid not in source_row:
                raise RuntimeError(
                    f"request {rid!r}: penalty history has an in-flight token the previous step did not sample"
                )
            holes = range(total + len(known), total + len(known) + s.num_history_placeholders)
            history_holes.extend(holes)
            history_sources.extend([source_row[rid]] * len(holes))
            parts.append(np.full(len(holes), PLACEHOLDER_TOKEN, dtype=np.int64))
        length = len(known) + s.num_history_placeholders
        rows.append(i)
        lengths.append(length)
        num_prompt.append(min(s.num_prompt_tokens, length))
        total += length
    tokens = np.concatenate(parts)  # [entries]
    del parts  # no view of a persistent history outlives this step's copy
    per_row = np.array(lengths, dtype=np.int64)  # [penalty rows]
    row_of = np.repeat(np.array(rows, dtype=np.int64), per_row)  # [entries]
    row_start = np.repeat(np.cumsum(per_row) - per_row, per_row)  # [entries]
    is_output = np.arange(total, dtype=np.int64) - row_start >= np.repeat(np.array(num_prompt), per_row)  # [entries]
    return PenaltyTensors(
        rows=to_device(torch.from_numpy(row_of)),
        tokens=to_device(torch.from_numpy(tokens)),
        is_output=to_device(torch.from_numpy(is_output)),
        presence=to_device(torch.tensor([s.presence_penalty for s in specs], dtype=torch.float32)),
        frequency=to_device(torch.tensor([s.frequency_penalty for s in specs], dtype=torch.float32)),
        repetition=to_device(torch.tensor([s.repetition_penalty for s in specs], dtype=torch.float32)),
    )
