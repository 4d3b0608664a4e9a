"""SamplingParams: what one request asks of generation, validated on construction."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from conveyor.errors import InvalidRequestError

MAX_STOP_TOKEN_IDS = 256


class SamplingParams(BaseModel):
    """Per-request generation settings (names and meaning follow OpenAI / vLLM).

    temperature == 0 means greedy decoding (top_k / top_p are then irrelevant).
    top_k == 0 (or -1) disables top-k; top_p == 1.0 disables nucleus sampling.
    A request without `seed` gets one drawn from the engine's seeded generator, so a run
    is reproducible as a whole; with `seed`, its tokens depend only on that seed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    max_tokens: int = Field(default=16, ge=1, le=10_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_k: int = Field(default=0, ge=-1)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = Field(default=(), max_length=MAX_STOP_TOKEN_IDS)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise InvalidRequestError(_explain(exc)) from None

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, ids: tuple[int, ...]) -> tuple[int, ...]:
        bad = [i for i in ids if i < 0]
        if bad:
            raise ValueError(f"token ids must be >= 0, saw {bad[0]}")
        return ids

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: Any) -> "SamplingParams":
        return SamplingParams(**{**self.model_dump(), **changes})


def _explain(exc: ValidationError) -> str:
    """One readable sentence per invalid field: field, value seen, allowed range."""
    parts = []
    for err in exc.errors():
        name = ".".join(str(p) for p in err["loc"]) or "SamplingParams"
        seen = err.get("input")
        reason = err["msg"]
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(SamplingParams.model_fields)
            parts.append(f"SamplingParams has no field {name!r}; known fields: {allowed}")
        else:
            parts.append(f"SamplingParams.{name}={seen!r} is invalid: {reason[0].lower() + reason[1:]}")
    return "; ".join(parts)
