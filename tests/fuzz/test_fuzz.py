"""The fuzzer in the fast suite: a hundred seeded mutants of tiny GGUF files and Hugging Face folders, each
inspected and loaded in a forked child under a memory limit and a timeout. None may crash, hang, raise anything but
ModelLoadError, or load computing something its tag does not allow (tests/fuzz/harness.py); the thousands of the
acceptance run (docs/models.md) take `python -m tests.fuzz.run`."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .harness import summarize
from .run import fuzz

FAST_SEEDS = (("llama", "F32"), ("llama", "Q4_1"), ("phi3", "Q5_0"), ("gemma2", "BF16"), ("llama-256", "Q4_K"))


def test_mutants_are_refused_by_name_or_load_unchanged(tmp_path: Any) -> None:
    results = fuzz(75, 25, seed=0, which={"tiny"}, workdir=str(tmp_path), tiny_gguf=FAST_SEEDS, tiny_timeout=45.0)
    assert all(r.passed for r in results), summarize(results)
    outcomes = Counter(r.outcome for r in results)
    assert len(results) == 100 and outcomes["refused"] > 60, outcomes  # the mutants do reach the checks
    assert outcomes["loaded-data"] + outcomes["loaded-value"] + outcomes["loaded-same"] > 5, outcomes
