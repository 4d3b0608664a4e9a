"""The interface every grammar engine implements: compile a constraint once, then one matcher per sample.

The engine advances a sample's matcher exactly once per committed token (never for tokens a
preempted request recomputes) and asks for the masks of a step's constrained rows in one batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from conveyor.structured.constraint import StructuredOutputs


class GrammarMatcher(Protocol):
    """The state of one sample in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance by one committed token; False when the grammar does not allow it."""

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token (the sample should stop)."""

    @property
    def error(self) -> str | None:
        """Why the matcher failed, or None."""


class CompiledGrammar(Protocol):
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (cheap: compilation is done)."""


class GrammarBackend(Protocol):
    name: str
    vocab_size: int
    """Width of every mask in tokens: the model's vocabulary (its LM head), not the tokenizer's length."""

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile (or fetch from the cache); raises InvalidRequestError naming the problem."""

    def fill_bitmask(
        self, matchers: Sequence[GrammarMatcher | None], bitmask: torch.Tensor, num_threads: int = 1
    ) -> None:
        """Row i of `bitmask` ([rows, ceil(vocab / 32)] int32, on the host) gets the tokens matcher i
        allows (bit t % 32 of word t // 32); a None matcher's row allows every token. The rows are shared
        among `num_threads` threads (the caller's own thread waits)."""
