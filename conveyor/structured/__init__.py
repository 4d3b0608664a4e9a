"""Structured output: grammar constraints (JSON schema, regex, choice, EBNF) on sampled tokens.

spec.py      StructuredOutputs: what a request asks for (one of json / json_object / regex / choice / grammar)
backend.py   the small interface every grammar engine implements (compile -> matcher per sample)
guidance.py  the llguidance backend: compile cache, time limit, batched bitmasks
bitmask.py   bitmasks as tensors: the deferred mask of a step, and applying it to logits
"""

from conveyor.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from conveyor.structured.constraint import StructuredOutputs

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarMatcher", "StructuredOutputs"]
