"""How many tokens each engine step handled, as a histogram (the server's vllm:iteration_tokens_total).

A step's tokens are counted as vLLM counts an iteration's: one per token sampled, plus the whole prompt of each
sequence that samples its first token in the step (computed then, in earlier chunks, or found in the prefix
cache). A decode step of one request is 1 token, the step that ends a prompt of P tokens and samples the first
reply token is P + 1, and a chunk of a longer prompt that samples nothing is 0.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Upper bounds of the histogram's buckets (vLLM's for the same histogram); a last bucket takes the rest."""


@dataclass
class StepTokens:
    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BUCKETS) + 1))
    """Steps per bucket (not cumulative): counts[i] holds the steps with at most STEP_TOKEN_BUCKETS[i] tokens and
    more than the bound before it; the last entry those above every bound."""
    total: int = 0
    """Tokens over all steps."""

    def observe(self, tokens: int, steps: int = 1) -> None:
        """`steps` steps of `tokens` tokens each."""
        self.counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, tokens)] += steps
        self.total += tokens * steps
