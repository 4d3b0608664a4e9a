"""GGUF metadata checked before it is used: every key either honoured (with its GGUF type and range checked) or
neutral, anything else refused by name; the tokenizer's arrays checked against each other and its token ids
against the vocabulary.

Each error names the file, the key, the value seen (with its GGUF type) and what is expected.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from gguf import GGUFValueType, Keys

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_file import GGUFFile
from conveyor.model.limits import (
    MAX_CONTEXT_LENGTH,
    MAX_HEAD_SIZE,
    MAX_HEADS,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_SCALE,
    MAX_VOCAB,
    MAX_WIDTH,
)

_INTS = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
_FLOATS = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})


class Rule(NamedTuple):
    """What a metadata value must be: 'int' (any GGUF integer type), 'float' (FLOAT32 / FLOAT64, finite),
    'str' or 'bool'; numbers within [low, high], and above low when low_open."""

    kind: str
    low: float = 0.0
    high: float = 0.0
    low_open: bool = False

    def describe(self) -> str:
        if self.kind == "int":
            return f"an integer from {int(self.low)} to {int(self.high)}"
        if self.kind == "float":
            return f"a finite float{' above' if self.low_open else ' from'} {self.low:g} (up to {self.high:g})"
        return "a string" if self.kind == "str" else "a bool"


def _count(low: int, high: int) -> Rule:
    return Rule("int", low, high)


def _positive(high: float = MAX_SCALE) -> Rule:
    return Rule("float", 0.0, high, low_open=True)


ARCH_RULES: dict[str, Rule] = {
    "vocab_size": _count(1, MAX_VOCAB),
    "context_length": _count(1, MAX_CONTEXT_LENGTH),
    "embedding_length": _count(1, MAX_WIDTH),
    "feed_forward_length": _count(1, MAX_INTERMEDIATE),
    "block_count": _count(1, MAX_LAYERS),
    "attention.head_count": _count(1, MAX_HEADS),
    "attention.head_count_kv": _count(1, MAX_HEADS),
    "attention.key_length": _count(2, MAX_HEAD_SIZE),
    "attention.value_length": _count(2, MAX_HEAD_SIZE),
    "attention.layer_norm_rms_epsilon": _positive(1.0),
    "rope.freq_base": _positive(),
    "rope.dimension_count": _count(2, MAX_HEAD_SIZE),
    "rope.scaling.type": Rule("str"),
    "rope.scaling.factor": _positive(),
    "rope.scaling.original_context_length": _count(1, MAX_CONTEXT_LENGTH),
    "rope.scaling.finetuned": Rule("bool"),
    "rope.scaling.yarn_beta_fast": _positive(),
    "rope.scaling.yarn_beta_slow": _positive(),
    "rope.scaling.yarn_attn_factor": _positive(),
    "rope.scaling.yarn_ext_factor": Rule("float", -1.0, 1.0),
    # honoured only by the architectures ARCH_EXTRAS names
    "attn_logit_softcapping": _positive(),
    "final_logit_softcapping": _positive(),
    "attention.sliding_window": _count(0, MAX_CONTEXT_LENGTH),
    "attention.sliding_window_pattern": _count(0, MAX_LAYERS),  # or one flag per layer (an array; gguf_loader)
    "rope.freq_base_swa": _positive(),
    "rope.scaling.attn_factor": _positive(),
}
"""`{arch}.` metadata keys read by the loader, with what each must be; any other `{arch}.` key is refused."""
ARCH_EXTRAS = {
    "gemma2": {"attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window"},
    "gemma3": {
        "final_logit_softcapping",
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "rope.freq_base_swa",
    },
    "phi3": {"attention.sliding_window", "rope.scaling.attn_factor"},
}
_COMMON_KEYS = set(ARCH_RULES) - set().union(*ARCH_EXTRAS.values())

TOKENIZER_KEYS = frozenset(v for k, v in vars(Keys.Tokenizer).items() if not k.startswith("_") and "{" not in v)
"""Every tokenizer.* key llama.cpp defines (the gguf package's list); tokenizer.chat_template.NAME too."""
_TOKEN_ID_KEYS = tuple(sorted(k for k in TOKENIZER_KEYS if k.endswith("_id")))
_TOKENIZER_RULES: dict[str, Rule] = {
    **{key: _count(0, MAX_VOCAB - 1) for key in _TOKEN_ID_KEYS},
    "tokenizer.ggml.model": Rule("str"),
    "tokenizer.ggml.pre": Rule("str"),
    "tokenizer.chat_template": Rule("str"),
    "tokenizer.huggingface.json": Rule("str"),
    "tokenizer.ggml.add_bos_token": Rule("bool"),
    "tokenizer.ggml.add_eos_token": Rule("bool"),
    "tokenizer.ggml.add_sep_token": Rule("bool"),
    "tokenizer.ggml.add_space_prefix": Rule("bool"),
    "tokenizer.ggml.remove_extra_whitespaces": Rule("bool"),
}
_TOKENIZER_ARRAYS = {  # key -> the element kind
    "tokenizer.ggml.tokens": "str",
    "tokenizer.ggml.merges": "str",
    "tokenizer.ggml.token_type": "int",
    "tokenizer.ggml.scores": "float",
    "tokenizer.chat_templates": "str",
    "tokenizer.ggml.precompiled_charsmap": "int",
}
_NEUTRAL_NAMESPACES = ("general.", "quantize.", "GGUF.")
"""Metadata that describes the file or how it was quantized: no effect on the computation (general.architecture
and general.alignment are checked where they are read)."""
TOKEN_TYPES = range(7)
"""llama.cpp's token types: undefined, normal, unknown, control, user-defined, unused, byte."""


def check_metadata(reader: GGUFFile, arch: str, path: str) -> None:
    """Refuse every metadata key that is not honoured and could change the computation, and every honoured one
    whose type or value is out of range."""
    honoured = _COMMON_KEYS | ARCH_EXTRAS.get(arch, set())
    for key in reader.fields:
        if key.startswith(_NEUTRAL_NAMESPACES):
            continue
        if key.startswith("tokenizer."):
            _check_tokenizer_key(reader, key, path)
            continue
        if key.startswith("split."):
            _check_value(reader, key, _count(0, 2**16), path)
            if key == "split.count" and reader.field(key) > 1:
                raise ModelLoadError(
                    f"{path}: split.count={reader.field(key)}: split GGUF files are not supported; "
                    f"merge them with llama.cpp's gguf-split --merge"
                )
            continue
        name = key[len(arch) + 1 :] if key.startswith(f"{arch}.") else None
        if name is None or name not in honoured:
            value = reader.field(key)
            shown = value if len(repr(value)) < 80 else f"{repr(value)[:80]}..."
            raise ModelLoadError(
                f"{path}: GGUF metadata {key}={shown!r} is not supported for {arch} (it would change "
                f"the computation, and Conveyor does not implement it); supported {arch}.* keys: "
                f"{', '.join(sorted(honoured))}"
            )
        if name == "attention.sliding_window_pattern" and reader.value_types[key][0] == GGUFValueType.ARRAY:
            _check_array(reader, key, "bool", path)
            continue
        _check_value(reader, key, ARCH_RULES[name], path)
    check_tokenizer(reader, path)


def _check_tokenizer_key(reader: GGUFFile, key: str, path: str) -> None:
    if key in _TOKENIZER_ARRAYS:
        _check_array(reader, key, _TOKENIZER_ARRAYS[key], path)
    elif key in _TOKENIZER_RULES:
        _check_value(reader, key, _TOKENIZER_RULES[key], path)
    elif key.startswith("tokenizer.chat_template."):
        _check_value(reader, key, Rule("str"), path)
    elif key not in TOKENIZER_KEYS:
        raise ModelLoadError(
            f"{path}: GGUF metadata key {key!r} is not a tokenizer key llama.cpp defines (a damaged key name?); "
            f"known: {', '.join(sorted(TOKENIZER_KEYS))}"
        )


def check_tokenizer(reader: GGUFFile, path: str) -> None:
    """The vocabulary is there; per-token arrays match it in length; token types and scores are in range; every
    special token id names a token of the vocabulary."""
    tokens = reader.field("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(
            f"{path}: GGUF metadata tokenizer.ggml.tokens is missing or empty; Conveyor needs the file's vocabulary"
        )
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        values = reader.field(key)
        if values is not None and len(values) != len(tokens):
            raise ModelLoadError(
                f"{path}: GGUF metadata {key} has {len(values)} entries; expected one per token "
                f"({len(tokens)}, as tokenizer.ggml.tokens has)"
            )
    token_types = reader.field("tokenizer.ggml.token_type")
    if token_types and not (TOKEN_TYPES.start <= min(token_types) and max(token_types) < TOKEN_TYPES.stop):
        bad = next(i for i, t in enumerate(token_types) if t not in TOKEN_TYPES)
        raise ModelLoadError(
            f"{path}: GGUF metadata tokenizer.ggml.token_type[{bad}]={token_types[bad]}; expected a llama.cpp "
            f"token type ({TOKEN_TYPES.start} to {TOKEN_TYPES.stop - 1})"
        )
    scores = reader.field("tokenizer.ggml.scores")
    if scores and not math.isfinite(sum(scores)):  # a NaN or infinity anywhere makes the sum one
        bad = next(i for i, s in enumerate(scores) if not math.isfinite(s))
        raise ModelLoadError(f"{path}: GGUF metadata tokenizer.ggml.scores[{bad}]={scores[bad]}; expected finite")
    for key in _TOKEN_ID_KEYS:
        value = reader.field(key)
        if value is not None and value >= len(tokens):
            raise ModelLoadError(
                f"{path}: GGUF metadata {key}={value} is outside the vocabulary of {len(tokens)} tokens "
                f"(tokenizer.ggml.tokens); expected 0 to {len(tokens) - 1}"
            )


def _check_value(reader: GGUFFile, key: str, rule: Rule, path: str) -> None:
    value = reader.field(key)
    value_type, _ = reader.value_types[key]
    if not _fits(value, value_type, rule):
        raise ModelLoadError(
            f"{path}: GGUF metadata {key}={_shown(value)} ({value_type.name}); expected {rule.describe()}"
        )


def _fits(value: Any, value_type: GGUFValueType, rule: Rule) -> bool:
    if rule.kind == "str":
        return value_type == GGUFValueType.STRING
    if rule.kind == "bool":
        return value_type == GGUFValueType.BOOL
    if rule.kind == "int":
        return value_type in _INTS and rule.low <= value <= rule.high
    if value_type not in _FLOATS or not math.isfinite(value):
        return False
    return (value > rule.low if rule.low_open else value >= rule.low) and value <= rule.high


def _check_array(reader: GGUFFile, key: str, element: str, path: str) -> None:
    value_type, element_type = reader.value_types[key]
    expected = {
        "str": {GGUFValueType.STRING},
        "int": _INTS,
        "float": _FLOATS,
        "bool": {GGUFValueType.BOOL} | _INTS,
    }[element]
    if value_type != GGUFValueType.ARRAY or element_type not in expected:
        seen = value_type.name if element_type is None else f"an array of {element_type.name}"
        raise ModelLoadError(f"{path}: GGUF metadata {key} is {seen}; expected an array of {element} values")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else f"{text[:80]}..."
