"""The llguidance backend (chosen by measurement: see docs/structured-output.md).

Compiling a constraint builds its lexer and parser tables once; the result is kept (LRU, per
canonical schema) and every sample gets a cheap deep copy. Compilation runs on a worker
thread (llguidance releases the GIL) under a wall-clock limit and llguidance's own fuel
limits, so a pathological schema is refused instead of stalling the engine.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from conveyor.errors import InvalidRequestError
from conveyor.structured.backend import GrammarMatcher
from conveyor.structured.constraint import StructuredOutputs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its stubs only

logger = logging.getLogger(__name__)

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is emitted compactly (one space after ',' and ':', no free whitespace): a model cannot pad it
with endless blanks. A schema's own "x-guidance" options override these."""


class GuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id))

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GuidanceGrammar:
    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template
        self._lock = threading.Lock()

    def new_matcher(self) -> GuidanceMatcher:
        with self._lock:
            return GuidanceMatcher(self._template.deep_copy())


class GuidanceBackend:
    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        compile_timeout_s: float = 10.0,
        cache_size: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
            )
        except Exception as exc:
            raise InvalidRequestError(
                f"structured output needs a fast (Rust) Hugging Face tokenizer; this model's "
                f"{type(tokenizer).__name__} could not be used ({exc})"
            ) from None
        self._cache: OrderedDict[tuple[str, str], GuidanceGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-grammar")
        self._executors: dict[int, llguidance.LLExecutor] = {}
        """One pool per thread count fill_bitmask was asked for (1: a host thread beside the forward)."""
        self.compile_times_s: list[float] = []
        """Seconds each compilation took (cache misses only), for benchmarks."""
        self.cache_size = cache_size

    def compile(self, spec: StructuredOutputs) -> GuidanceGrammar:
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = self._compile(spec)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutputs) -> GuidanceGrammar:
        what = {
            "json": "JSON schema",
            "json_object": "JSON object",
            "regex": "regex",
            "choice": "choice",
            "grammar": "grammar",
        }[spec.kind]
        try:
            source = _grammar_source(spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(
                f"SamplingParams.structured_outputs: the {what} cannot be compiled: {exc}"
            ) from None
        start = time.perf_counter()
        future = self._compiler.submit(llguidance.LLMatcher, self.tokenizer, source, log_level=0)
        try:
            template = future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise InvalidRequestError(
                f"SamplingParams.structured_outputs: compiling the {what} took longer than "
                f"{self.compile_timeout_s:g} s; simplify it"
            ) from None
        except Exception as exc:
            raise InvalidRequestError(
                f"SamplingParams.structured_outputs: the {what} cannot be compiled: {exc}"
            ) from None
        if template.is_error():
            raise InvalidRequestError(
                f"SamplingParams.structured_outputs: the {what} cannot be compiled: {template.get_error()}"
            )
        self.compile_times_s.append(time.perf_counter() - start)
        return GuidanceGrammar(template)

    def fill_bitmask(
        self, matchers: Sequence[GrammarMatcher | None], bitmask: torch.Tensor, num_threads: int = 1
    ) -> None:
        # numpy's fill, not torch's: this runs on the engine's host thread, and a torch op large enough to go
        # parallel (98k words at 64 rows) would start a second OpenMP team there, whose threads then fight
        # the forward's for the cores on every later step (runtime/overlap.py: every decode step after the first
        # constrained one stays slower)
        bitmask.numpy().fill(-1)
        live = []
        for i, m in enumerate(matchers):
            if m is None:
                continue
            if not isinstance(m, GuidanceMatcher):  # each comes from this backend's grammars: else a caller's bug
                raise TypeError(f"matcher {i} is a {type(m).__name__}, not one of the llguidance backend's")
            if not m.matcher.is_error():
                live.append((m.matcher, i))
        if live:
            executor = self._executors.get(num_threads)
            if executor is None:
                executor = self._executors.setdefault(num_threads, llguidance.LLExecutor(num_threads=num_threads))
            llguidance.torch.fill_next_token_bitmask_par(executor, live, bitmask)

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)


def _grammar_source(spec: StructuredOutputs) -> str:
    kind = spec.kind
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec.schema), defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice or ()))
    return llguidance.grammar_from("grammar", spec.grammar or "")
