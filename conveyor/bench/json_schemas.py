"""Random JSON schemas (deterministic per seed): the structured-output tests' and the compile-time benchmark's."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["red", "green", "blue", "cat", "dog", "alpha", "beta", "x", "yes", "no"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Nested objects, arrays, enums, bounded numbers, required / optional, additionalProperties false."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 8)}
        if rng.random() < 0.3:
            schema["minLength"] = 1
        return schema
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        bottom = rng.choice([-10.0, 0.0, 0.5, 3.0])
        return {"type": "number", "minimum": bottom, "maximum": bottom + rng.choice([1.0, 10.0, 100.0])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        values: list[Any] = rng.sample(WORDS, rng.randint(1, 4))
        if rng.random() < 0.3:
            values.append(rng.randint(0, 9))
        return {"enum": values}
    if kind == "array":
        low = rng.randint(0, 1)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "pos", "meta"], rng.randint(1, 4))
    properties = {n: random_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
