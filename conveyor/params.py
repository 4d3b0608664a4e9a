"""SamplingParams: what one request asks of generation, validated on construction.

Names and meaning follow OpenAI and vLLM. The order in which the sampler applies them:

    raw logits -> logit_bias -> min_tokens (EOS / stop tokens masked) -> repetition penalty
    (prompt + output, as transformers) -> presence / frequency penalties (output only, as
    OpenAI) -> [greedy: argmax here] -> temperature -> top-k -> top-p -> min-p -> sample.

`logprobs` / `prompt_logprobs` are computed from the raw model logits (log_softmax before
any of the steps above), which is vLLM's documented default ("raw_logprobs").
"""

from __future__ import annotations

import math
import operator
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from conveyor.errors import InvalidRequestError
from conveyor.structured.constraint import StructuredOutputs

MAX_STOP_TOKEN_IDS = 256
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_LOGPROBS = 20
MAX_N = 128
MAX_LOGIT_BIAS_ENTRIES = 1024


def _whole_number(value: Any) -> Any:
    """An integer field takes integers (numpy's too), never a bool, a string or a float."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"must be a whole number, got a {type(value).__name__}")
    return operator.index(value)


def _real_number(value: Any) -> Any:
    """A float field takes numbers (integers too), never a bool or a string, and no NaN."""
    if isinstance(value, (bool, str, bytes)) or (
        not isinstance(value, (int, float)) and not hasattr(value, "__float__")
    ):
        raise ValueError(f"must be a number, got a {type(value).__name__}")
    if math.isnan(float(value)):
        raise ValueError("must be a number, got NaN")
    return float(value)


WholeNumber = Annotated[int, BeforeValidator(_whole_number)]
RealNumber = Annotated[float, BeforeValidator(_real_number)]


class SamplingParams(BaseModel):
    """Per-request generation settings.

    temperature == 0 means greedy decoding. top_k of 0 or -1, top_p of 1.0, min_p of 0.0 and
    penalties of 0 (repetition_penalty 1.0) turn those steps off. A request without `seed`
    gets one drawn from the engine's seeded generator; with one, its tokens depend only on
    that seed (never on the batch around it, nor on async vs sync execution).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n: WholeNumber = Field(default=1, ge=1, le=MAX_N)
    max_tokens: WholeNumber | None = Field(default=16, ge=1, le=10_000_000)
    """None: generate until EOS, a stop condition or max_model_len."""
    min_tokens: WholeNumber = Field(default=0, ge=0)
    temperature: RealNumber = Field(default=1.0, ge=0.0, le=100.0)
    top_k: WholeNumber = Field(default=0, ge=-1)
    top_p: RealNumber = Field(default=1.0, gt=0.0, le=1.0)
    min_p: RealNumber = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: RealNumber = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: RealNumber = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: RealNumber = Field(default=1.0, ge=0.01, le=10.0)
    """Divides a seen token's positive logit (multiplies a negative one); from 0.01 up, so the result stays finite
    (a much smaller penalty turns finite logits into infinities)."""
    seed: WholeNumber | None = Field(default=None, ge=-(2**63), lt=2**63)
    """Any 64-bit signed integer, as OpenAI and vLLM accept (negative ones too); the draws hash all 64 bits
    (two's complement), so every seed draws its own sequence."""
    stop: tuple[str, ...] = Field(default=(), max_length=MAX_STOP_STRINGS)
    stop_token_ids: tuple[WholeNumber, ...] = Field(default=(), max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    logprobs: WholeNumber | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: WholeNumber | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS_ENTRIES)
    skip_special_tokens: StrictBool = True
    structured_outputs: StructuredOutputs | None = None
    """A grammar the output must follow: {"json": schema} | {"json_object": True} | {"regex": ...} |
    {"choice": [...]} | {"grammar": EBNF}. vLLM's older guided_json / guided_regex / guided_choice /
    guided_grammar keywords are accepted and mean the same."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**_guided_fields(data))
        except ValidationError as exc:
            raise InvalidRequestError(_explain(exc), _field_of(exc)) from None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, value: str | list[str] | tuple[str, ...] | None) -> Any:
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stops: tuple[str, ...]) -> tuple[str, ...]:
        for s in stops:
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"a stop string has {len(s)} characters; at most {MAX_STOP_STRING_CHARS}")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, ids: tuple[int, ...]) -> tuple[int, ...]:
        bad = [i for i in ids if i < 0]
        if bad:
            raise ValueError(f"token ids must be >= 0, saw {bad[0]}")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[int, float]) -> dict[int, float]:
        for token, value in bias.items():
            if token < 0:
                raise ValueError(f"token ids must be >= 0, saw {token}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias {value} for token {token} is outside [-100, 100]")
        return bias

    @model_validator(mode="after")
    def _cross_field(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldValueError(
                "min_tokens", f"min_tokens={self.min_tokens} is larger than max_tokens={self.max_tokens}"
            )
        if self.structured_outputs is not None:
            if self.min_tokens:
                raise FieldValueError(
                    "min_tokens",
                    f"SamplingParams.min_tokens={self.min_tokens} cannot be combined with structured_outputs: the "
                    f"grammar decides where the output ends (a complete output may be shorter)",
                )
            if self.ignore_eos:
                raise FieldValueError(
                    "ignore_eos",
                    "SamplingParams.ignore_eos=True cannot be combined with structured_outputs: the grammar decides "
                    "where the output ends",
                )
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self, **changes: Any) -> SamplingParams:
        return SamplingParams(**{**self.model_dump(), **changes})


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _guided_fields(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's older guided_* keywords -> structured_outputs (only one constraint at a time)."""
    given = {k: data[k] for k in _GUIDED if data.get(k) is not None}
    if not given:
        return {k: v for k, v in data.items() if k not in _GUIDED}
    if data.get("structured_outputs") is not None or len(given) > 1:
        named = sorted(given) + (["structured_outputs"] if data.get("structured_outputs") is not None else [])
        raise InvalidRequestError(
            f"SamplingParams.structured_outputs: give one constraint, got {', '.join(named)}",
            param="structured_outputs",
        )
    ((name, value),) = given.items()
    rest = {k: v for k, v in data.items() if k not in _GUIDED}
    return rest | {"structured_outputs": {_GUIDED[name]: value}}


class FieldValueError(ValueError):
    """A check across fields that still blames one of them (reported as the error's `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _field_of(exc: ValidationError) -> str | None:
    """The first field a validation error names (None when it is about the whole object)."""
    for err in exc.errors():
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, FieldValueError):
            return cause.field
        if err["loc"] and err["type"] != "extra_forbidden":
            return str(err["loc"][0])
    return None


def _explain(exc: ValidationError) -> str:
    """One readable sentence per invalid field: field, value seen, allowed range."""
    parts = []
    for err in exc.errors():
        name = ".".join(str(p) for p in err["loc"]) or "SamplingParams"
        seen = err.get("input")
        reason = err["msg"]
        if reason.startswith("Value error, "):
            reason = reason[len("Value error, ") :]
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(SamplingParams.model_fields)
            parts.append(f"SamplingParams has no field {name!r}; known fields: {allowed}")
        elif name == "SamplingParams" or not err["loc"]:
            parts.append(reason if reason.startswith("SamplingParams.") else f"SamplingParams is invalid: {reason}")
        else:
            parts.append(f"SamplingParams.{name}={seen!r} is invalid: {reason[0].lower() + reason[1:]}")
    return "; ".join(parts)
