"""What the engine reports about itself (server metrics, benchmarks, the device idle fraction)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_steps: int
    num_preemptions: int
    num_partial_prefills: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preempted_waiting: int
    """Waiting requests that were preempted (their KV freed) and wait to be recomputed."""
    num_generated_tokens: int
    num_non_finite: int
    """Requests ended with an error because the model's logits for them held NaN or infinity."""
    async_batching: bool
    device_busy_s: float
    active_s: float
    step_token_counts: tuple[int, ...] = ()
    """Steps run per bucket of core.step_tokens.STEP_TOKEN_BUCKETS, by their tokens as vLLM counts an iteration's
    (core/step_tokens.py); not cumulative, the last entry past every bound."""
    step_tokens_total: int = 0
    """The steps' tokens (as counted for step_token_counts), over all steps."""

    @property
    def kv_blocks_used(self) -> int:
        """Blocks held by requests (neither free nor kept only as evictable prefix cache)."""
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up (0 before any lookup)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def device_idle_fraction(self) -> float:
        """Share of the engine's active wall time in which the device waited for the host."""
        return 0.0 if self.active_s <= 0 else max(0.0, 1.0 - self.device_busy_s / self.active_s)
