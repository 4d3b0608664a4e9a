"""StructuredOutputs: the constraint one request asks for (vLLM's `structured_outputs` names)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1024
MAX_SOURCE_CHARS = 200_000


class StructuredOutputs(BaseModel):
    """Exactly one of the fields: `json` (a JSON schema, as a dict or a string), `json_object`
    (any JSON object), `regex`, `choice` (the output is one of these strings) or `grammar`
    (EBNF / GBNF, or llguidance's Lark)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = Field(default=None, max_length=MAX_SOURCE_CHARS)
    choice: tuple[StrictStr, ...] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: StrictStr | None = Field(default=None, max_length=MAX_SOURCE_CHARS)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in KINDS if self._value(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of {', '.join(KINDS)} (json_object=True for any JSON object); "
                f"got {', '.join(given) if given else 'none'}"
            )
        if isinstance(self.json_, str):
            try:
                parsed = json.loads(self.json_)
            except ValueError as exc:
                raise ValueError(f"the json schema string is not valid JSON ({exc})") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"a JSON schema is an object, got a {type(parsed).__name__}")
        if self.choice is not None and any(not c for c in self.choice):
            raise ValueError("choice strings must be non-empty")
        return self

    def _value(self, kind: str) -> Any:
        return self.json_ if kind == "json" else getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._value(k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical source): equal constraints share one compiled grammar."""
        value = self._value(self.kind)
        if self.kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            return "json", json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return "choice", json.dumps(list(value))
        if self.kind == "json_object":
            return "json_object", ""
        return self.kind, value

    @property
    def schema(self) -> Any:
        """The JSON schema (a dict) for `json`; {"type": "object"} for json_object; None otherwise."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind == "json":
            return json.loads(self.json_) if isinstance(self.json_, str) else self.json_
        return None
