"""A StepPlan as bytes and back, for the tensor-parallel workers: JSON of plain lists, never pickle.

Each dataclass travels as the list of its field values in declaration order (the reader rebuilds it with
the same fields), so the wire carries only numbers, strings, booleans, null and lists; tuples come back as
tuples where the plan declares them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from conveyor.core.plan import SamplingSpec, ScheduledSeq, StepPlan

_SEQ_FIELDS = [f.name for f in dataclasses.fields(ScheduledSeq)]
_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingSpec)]
_PLAN_FIELDS = [f.name for f in dataclasses.fields(StepPlan)]


def encode_plan(plan: StepPlan) -> bytes:
    def seq(s: ScheduledSeq) -> list[Any]:
        values = [getattr(s, name) for name in _SEQ_FIELDS]
        if s.sampling is not None:
            values[_SEQ_FIELDS.index("sampling")] = [getattr(s.sampling, name) for name in _SAMPLING_FIELDS]
        return values

    values: list[Any] = [getattr(plan, name) for name in _PLAN_FIELDS]
    values[_PLAN_FIELDS.index("seqs")] = [seq(s) for s in plan.seqs]
    return json.dumps(values, separators=(",", ":"), allow_nan=False).encode()


def decode_plan(data: bytes) -> StepPlan:
    raw = dict(zip(_PLAN_FIELDS, json.loads(data)))
    seqs = []
    for values in raw["seqs"]:
        fields = dict(zip(_SEQ_FIELDS, values))
        if fields["sampling"] is not None:
            sampling = dict(zip(_SAMPLING_FIELDS, fields["sampling"]))
            sampling["logit_bias"] = tuple((int(t), float(b)) for t, b in sampling["logit_bias"])
            sampling["suppress_token_ids"] = tuple(sampling["suppress_token_ids"])
            if sampling["history_tail"] is not None:
                sampling["history_tail"] = tuple(sampling["history_tail"])
            fields["sampling"] = SamplingSpec(**sampling)
        seqs.append(ScheduledSeq(**fields))
    raw["seqs"] = seqs
    raw["block_copies"] = [(int(a), int(b)) for a, b in raw["block_copies"]]
    return StepPlan(**raw)
