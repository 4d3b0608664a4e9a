"""What structured output costs: a decode step with every row JSON-constrained against the same step
unconstrained (async batching on and off), and grammar compile times.

Constrained rows follow schemas that keep them inside the grammar for the whole measurement (long
strings, long arrays of numbers, arrays of small objects), so every timed step computes a mask per
row on the host and applies it on the device side. The two kinds of step alternate, round by round,
on one engine per mode, so machine noise falls on both alike.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from conveyor.bench.decode_step import timed_decode_steps
from conveyor.bench.json_schemas import random_object
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.params import SamplingParams

LONG_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"notes": {"type": "string", "minLength": 2000}},
        "required": ["notes"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}, "minItems": 1000},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["name", "score"],
            "additionalProperties": False,
        },
        "minItems": 300,
    },
]


def _timed_steps(engine: Any, prompts: list[list[int]], params: list[SamplingParams], steps: int) -> list[float]:
    seconds = timed_decode_steps(engine, prompts, params, steps)
    engine.check_idle()
    return seconds


def measure_step_cost(config: EngineConfig, num_seqs: int, prompt_len: int, steps: int, rounds: int) -> dict[str, Any]:
    from conveyor.engine.engine import Engine

    result: dict[str, Any] = {
        "num_seqs": num_seqs,
        "prompt_len": prompt_len,
        "steps": steps,
        "rounds": rounds,
        "schemas": LONG_SCHEMAS,
        "modes": {},
    }
    for async_batching in (True, False):
        engine = Engine(config.replace(async_batching=async_batching))
        prompts = random_workload(num_seqs, (prompt_len, prompt_len), (1, 1), engine.spec.vocab_size).prompts
        free = [SamplingParams(max_tokens=4 * steps + 64, temperature=0.0, ignore_eos=True)] * num_seqs
        constrained = [
            SamplingParams(
                max_tokens=4 * steps + 64,
                temperature=0.0,
                structured_outputs={"json": LONG_SCHEMAS[i % len(LONG_SCHEMAS)]},
            )
            for i in range(num_seqs)
        ]
        _timed_steps(engine, prompts, constrained, 2)  # warm-up: compile the schemas, build the vocabulary index
        times: dict[str, list[float]] = {"unconstrained": [], "json": []}
        for _ in range(rounds):
            times["unconstrained"] += _timed_steps(engine, prompts, free, steps)
            times["json"] += _timed_steps(engine, prompts, constrained, steps)
        engine.close()
        free_ms = statistics.median(times["unconstrained"]) * 1e3
        json_ms = statistics.median(times["json"]) * 1e3
        result["modes"]["async" if async_batching else "sync"] = {
            "async_batching": engine.async_batching,
            "dtype": engine.dtype,
            "unconstrained_step_ms": free_ms,
            "json_step_ms": json_ms,
            "ratio": json_ms / free_ms,
            "unconstrained_all_ms": [t * 1e3 for t in times["unconstrained"]],
            "json_all_ms": [t * 1e3 for t in times["json"]],
        }
    return result


def measure_compile_times(config: EngineConfig, num_schemas: int = 200, seed: int = 19) -> dict[str, Any]:
    """Compile the structured-output tests' random schemas with a fresh backend (no cache), then again (cached)."""
    from conveyor.model.loader import load_model
    from conveyor.structured.constraint import StructuredOutputs
    from conveyor.structured.guidance import GuidanceBackend

    loaded = load_model(config.model, "float32")
    start = time.perf_counter()
    backend = GuidanceBackend(
        loaded.tokenizer, loaded.spec.vocab_size, loaded.spec.eos_token_ids, config.structured_output_timeout
    )
    index_s = time.perf_counter() - start
    rng = random.Random(seed)
    specs = [StructuredOutputs(json=random_object(rng)) for _ in range(num_schemas)]
    for spec in specs:
        backend.compile(spec)
    first = list(backend.compile_times_s)
    cached = []
    for spec in specs:
        start = time.perf_counter()
        backend.compile(spec)
        cached.append(time.perf_counter() - start)
    return {
        "num_schemas": num_schemas,
        "vocabulary_index_s": index_s,
        "compile_ms_median": statistics.median(first) * 1e3,
        "compile_ms_max": max(first) * 1e3,
        "cached_ms_median": statistics.median(cached) * 1e3,
        "cached_ms_max": max(cached) * 1e3,
    }
