"""The engine's side of structured output: one grammar backend, a matcher per sample, each step's masks."""

from __future__ import annotations

from typing import Any

import torch

from conveyor.core.plan import StepPlan
from conveyor.engine.output import OutputProcessor
from conveyor.errors import InvalidRequestError
from conveyor.model.runner import PreparedStep
from conveyor.model.spec import ModelSpec
from conveyor.params import SamplingParams
from conveyor.runtime.trace import Tracer
from conveyor.structured.backend import GrammarBackend, GrammarMatcher
from conveyor.structured.bitmask import bitmask_words


class EngineGrammars:
    def __init__(self, tokenizer: Any, spec: ModelSpec, compile_timeout_s: float, model_source: str) -> None:
        self._tokenizer = tokenizer
        self._spec = spec
        self._timeout = compile_timeout_s
        self._source = model_source
        self._backend: GrammarBackend | None = None

    @property
    def backend(self) -> GrammarBackend:
        """llguidance, built on first use (it indexes the vocabulary once, ~0.3 s for 49,152 tokens)."""
        if self._backend is None:
            if self._tokenizer is None:
                raise InvalidRequestError(f"SamplingParams.structured_outputs needs a tokenizer, and model "
                                          f"{self._source} has none")
            from conveyor.structured.guidance import GuidanceBackend

            self._backend = GuidanceBackend(self._tokenizer, self._spec.vocab_size, self._spec.eos_token_ids,
                                            self._timeout)
        return self._backend

    def matchers(self, params: SamplingParams) -> list[GrammarMatcher] | None:
        """One matcher per sample, from the compiled (cached) grammar; raises InvalidRequestError."""
        if params.structured_outputs is None:
            return None
        grammar = self.backend.compile(params.structured_outputs)
        return [grammar.new_matcher() for _ in range(params.n)]

    def fill(self, plan: StepPlan, prepared: PreparedStep, outputs: OutputProcessor, tracer: Tracer) -> None:
        """Compute the step's masks from the committed tokens (every token before the ones this step
        samples must be committed by now) and hand them to the step; a failure reaches the step too."""
        if prepared.grammar is None or prepared.grammar.is_set:
            return
        try:
            matchers = outputs.matchers_of(plan)
            bitmask = torch.empty((len(matchers), bitmask_words(self._spec.vocab_size)), dtype=torch.int32)
            with tracer.span("grammar", step=plan.step_id, seqs=len(matchers)):
                self.backend.fill_bitmask(matchers, bitmask)
            prepared.grammar.set(bitmask)
        except BaseException as exc:
            prepared.grammar.fail(exc)
            raise
