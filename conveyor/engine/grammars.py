"""The engine's side of structured output: one grammar backend, a matcher per sample, each step's masks.

Where a step's masks are computed:
- CUDA: on the host thread, on one thread, as soon as the step before is committed; the step is
  launched once they are set (runtime/cuda_streams.py).
- CPU: by the thread that samples the step, once its forward is done, in parallel over torch's
  thread count. A host thread computing them during the forward takes a core from the forward's
  OpenMP team, whose every parallel region then waits for the slowed thread: the forward loses more
  time than the masks take (`conveyor bench structured` measures both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conveyor.core.plan import StepPlan
from conveyor.engine.output import OutputProcessor
from conveyor.errors import InvalidRequestError
from conveyor.model.model_spec import ModelSpec
from conveyor.model.runner import PreparedStep
from conveyor.params import SamplingParams
from conveyor.runtime.trace import DEVICE_LANE, HOST_LANE, Tracer
from conveyor.structured.backend import GrammarBackend, GrammarMatcher
from conveyor.structured.bitmask import bitmask_words


class EngineGrammars:
    def __init__(
        self,
        tokenizer: Any,
        spec: ModelSpec,
        compile_timeout_s: float,
        model_source: str,
        masks_when_sampled: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._spec = spec
        self._timeout = compile_timeout_s
        self._source = model_source
        self._backend: GrammarBackend | None = None
        self.masks_when_sampled = masks_when_sampled
        """True (CPU): a step's masks are computed by its sampling thread, with torch's thread count;
        False (CUDA): by the host thread, on one thread, while the device runs (see the module docstring)."""

    @property
    def backend(self) -> GrammarBackend:
        """llguidance, built on first use (it indexes the whole vocabulary once, which takes a while)."""
        if self._backend is None:
            if self._tokenizer is None:
                raise InvalidRequestError(
                    f"SamplingParams.structured_outputs needs a tokenizer, and model {self._source} has none"
                )
            from conveyor.structured.guidance import GuidanceBackend

            self._backend = GuidanceBackend(
                self._tokenizer, self._spec.vocab_size, self._spec.eos_token_ids, self._timeout
            )
        return self._backend

    def matchers(self, params: SamplingParams) -> list[GrammarMatcher] | None:
        """One matcher per sample, from the compiled (cached) grammar; raises InvalidRequestError."""
        if params.structured_outputs is None:
            return None
        grammar = self.backend.compile(params.structured_outputs)
        return [grammar.new_matcher() for _ in range(params.n)]

    def fill(self, plan: StepPlan, prepared: PreparedStep, outputs: OutputProcessor, tracer: Tracer) -> None:
        """Every token before the ones this step samples is committed now: hand the step its masks (computed
        here, or by its sampling thread when `masks_when_sampled`); a failure reaches the step too."""
        if prepared.grammar is None or prepared.grammar.is_set:
            return
        try:
            matchers = outputs.matchers_of(plan)  # resolved now: the output processor belongs to this thread
            if self.masks_when_sampled:
                prepared.grammar.set_filler(
                    lambda: self._masks(matchers, plan.step_id, tracer, DEVICE_LANE, torch.get_num_threads())
                )
            else:
                prepared.grammar.set(self._masks(matchers, plan.step_id, tracer, HOST_LANE, 1))
        except BaseException as exc:
            prepared.grammar.fail(exc)
            raise

    def _masks(
        self, matchers: Sequence[GrammarMatcher | None], step_id: int, tracer: Tracer, lane: int, num_threads: int
    ) -> torch.Tensor:
        bitmask = torch.empty((len(matchers), bitmask_words(self._spec.vocab_size)), dtype=torch.int32)
        with tracer.span("grammar", lane=lane, step=step_id, seqs=len(matchers)):
            self.backend.fill_bitmask(matchers, bitmask, num_threads)
        return bitmask  # [rows, words]
