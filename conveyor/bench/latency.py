"""Single-request latency (time to first token, time per output token), ours and the peers interleaved.

Shared machines are noisy (one contestant's time per token can move by half within an hour), so the
contestants take turns: a warm-up run each, then `runs` rounds of one run each,
and the medians. A slow minute then slows every contestant alike instead of whichever ran in it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Protocol

from conveyor.params import SamplingParams


class LatencyRunner(Protocol):
    """One contestant: runs the request once, returns (seconds to first token, seconds per later token)."""

    def once(self) -> tuple[float, float]: ...

    def close(self) -> None: ...


class ConveyorLatency:
    """Our engine, one request at a time, the prefix cache cleared before each run."""

    def __init__(self, engine: Any, prompt: list[int], output_len: int) -> None:
        self.engine = engine
        self.prompt = prompt
        self.output_len = output_len
        self.params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def once(self) -> tuple[float, float]:
        self.engine.reset_prefix_cache()
        start = time.perf_counter()
        self.engine.add_request(self.prompt, self.params)
        first: float | None = None
        while self.engine.has_work():
            for out in self.engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None, "the request produced no token"
        return first - start, (end - first) / (self.output_len - 1)

    def close(self) -> None:
        self.engine.close()


class HFGenerateLatency:
    """transformers `generate`: one call for the first token, one for all of them; the difference per token."""

    def __init__(self, model_path: str, prompt: list[int], output_len: int, dtype: str) -> None:
        import torch

        from conveyor.bench.peers import hf_model

        self.torch = torch
        self.model = hf_model(model_path, dtype)
        self.ids = torch.tensor([prompt])
        self.output_len = output_len

    def once(self) -> tuple[float, float]:
        with self.torch.inference_mode():
            start = time.perf_counter()
            self.model.generate(self.ids, max_new_tokens=1, do_sample=False, eos_token_id=-1, pad_token_id=0)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            self.model.generate(
                self.ids,
                max_new_tokens=self.output_len,
                min_new_tokens=self.output_len,
                do_sample=False,
                eos_token_id=-1,
                pad_token_id=0,
            )
            total = time.perf_counter() - start
        return ttft, (total - ttft) / (self.output_len - 1)

    def close(self) -> None:
        del self.model


def interleaved(runners: dict[str, LatencyRunner], runs: int) -> dict[str, dict[str, Any]]:
    """name -> {ttft_s, tpot_s (medians), ttft_runs_s, tpot_runs_s}; every runner is closed."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    try:
        for runner in runners.values():  # warm-up
            runner.once()
        for _ in range(runs):
            for name, runner in runners.items():
                samples[name].append(runner.once())
    finally:
        for runner in runners.values():
            runner.close()
    return {
        name: {
            "ttft_s": statistics.median(t for t, _ in got),
            "tpot_s": statistics.median(p for _, p in got),
            "ttft_runs_s": [t for t, _ in got],
            "tpot_runs_s": [p for _, p in got],
        }
        for name, got in samples.items()
    }
