"""EngineInfo: what a frontend may know about a ready engine, frozen once the model is loaded.

Frontends (server/, llm.py, cli.py, bench/) read the model's tokenizer, vocabulary, context
length and sampling defaults here instead of reaching into the engine's parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class EngineInfo:
    model_source: str
    """Where the weights came from (a folder, a GGUF file, or the embedded default model)."""
    tokenizer: Any
    """The model's Hugging Face tokenizer, or None for a model without one (token-id prompts only).
    Shared: use it from one thread at a time or copy it (see docs/design/step-loop.md, "Threads")."""
    vocab_size: int
    max_model_len: int
    sampling_defaults: Mapping[str, Any]
    """The model's recommended sampling settings (from its generation config); read-only."""
    eos_token_ids: tuple[int, ...]
    dtype: str
    """The compute dtype in use ('auto' resolved)."""
    device: str
    async_batching: bool
    kernels: str = "torch"
    """The CPU kernels in use: the native kernels' ISA tier ('amx', 'avx512', 'avx2', 'portable';
    conveyor/model/isa.py), or 'torch' for torch's ops (kernels='torch', a GPU, or no build yet)."""

    @staticmethod
    def freeze(defaults: Mapping[str, Any]) -> Mapping[str, Any]:
        return MappingProxyType(dict(defaults))
