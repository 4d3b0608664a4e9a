"""Benchmark workloads: fixed-seed random-token prompts, EOS ignored (nano-vllm's shape)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from conveyor.params import SamplingParams


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def num_output_tokens(self) -> int:
        total = 0
        for p in self.params:
            if p.max_tokens is None:  # the workloads above always set it (ignore_eos runs each to its length)
                raise ValueError(f"workload {self.name!r}: a request without max_tokens has no output length")
            total += p.max_tokens
        return total

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def random_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    temperature: float = 0.0,
    name: str = "random",
) -> Workload:
    """Prompt and output lengths uniform in the given ranges (inclusive); greedy unless temperature > 0."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(num_requests):
        length = rng.randint(*input_len)
        prompts.append([rng.randrange(100, vocab_size - 100) for _ in range(length)])
        params.append(
            SamplingParams(
                max_tokens=rng.randint(*output_len), temperature=temperature, seed=seed * 100_003 + i, ignore_eos=True
            )
        )
    return Workload(name, prompts, params)


def shared_prefix_workload(
    num_requests: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """Many requests behind one long shared system prompt (prefix caching's best case)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab_size - 100) for _ in range(prefix_len)]
    inner = random_workload(num_requests, suffix_len, output_len, vocab_size, seed=seed + 1, name="shared-prefix")
    return Workload("shared-prefix", [prefix + p for p in inner.prompts], inner.params)
