"""A checkpoint's JSON files read safely, and config.json values checked for type and range before the loader reads
them: sizes are integers within bounds, scales finite and positive, flags booleans (a string "false" is not false),
token ids integers. Each error names the file, the field, the value seen and what is expected; what the fields mean
is hf_loader's business."""

from __future__ import annotations

import json
import math
from typing import Any

from conveyor.errors import ModelLoadError
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

MAX_JSON_BYTES = 64 * 2**20
"""config.json and generation_config.json are a few kilobytes; anything past this is not one."""

REQUIRED_INTS = {
    "vocab_size": MAX_VOCAB,
    "hidden_size": MAX_WIDTH,
    "intermediate_size": MAX_INTERMEDIATE,
    "num_hidden_layers": MAX_LAYERS,
    "num_attention_heads": MAX_HEADS,
}
OPTIONAL_INTS = {
    "num_key_value_heads": (1, MAX_HEADS),
    "head_dim": (2, MAX_HEAD_SIZE),
    "max_position_embeddings": (1, MAX_CONTEXT_LENGTH),
    "original_max_position_embeddings": (1, MAX_CONTEXT_LENGTH),
    "sliding_window": (0, MAX_CONTEXT_LENGTH),
    "max_window_layers": (0, MAX_LAYERS),
    "bos_token_id": (0, MAX_VOCAB - 1),
}
POSITIVE_FLOATS = (
    "rope_theta",
    "rope_local_base_freq",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "partial_rotary_factor",
)
BOOLS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "use_bidirectional_attention", "mlp_bias")
_ROPE_NUMBERS = (
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "partial_rotary_factor",
)


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from a checkpoint's file; anything else is a ModelLoadError naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise ModelLoadError(f"{path}: over {MAX_JSON_BYTES} bytes; not a configuration file")
        value = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON (or over MAX_JSON_BYTES), nested too deep
        raise ModelLoadError(f"{path}: not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: holds a JSON {type(value).__name__}; expected an object")
    return value


def check_config_values(config: dict[str, Any], path: str) -> None:
    for key, high in REQUIRED_INTS.items():
        if key not in config:
            raise ModelLoadError(f"{path}: {key} is missing; a Hugging Face config.json of a decoder states it")
        _int(config, key, 1, high, path)
    for key, (low, high) in OPTIONAL_INTS.items():
        _int(config, key, low, high, path)
    eos = config.get("eos_token_id")
    for token in eos if isinstance(eos, list) else [eos]:
        if token is not None and not (_is_int(token) and 0 <= token < MAX_VOCAB):
            raise ModelLoadError(f"{path}: eos_token_id={eos!r}; expected a token id or a list of them")
    if "rms_norm_eps" in config and config["rms_norm_eps"] is not None:
        _positive(config["rms_norm_eps"], "rms_norm_eps", path, high=1.0)
    for key in POSITIVE_FLOATS:
        _positive(config.get(key), key, path)
    for key in BOOLS:
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise ModelLoadError(f"{path}: {key}={config[key]!r}; expected true or false")
    for key in ("rope_scaling", "rope_parameters"):
        _check_rope(config.get(key), key, path)
    layer_types = config.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise ModelLoadError(f"{path}: layer_types={_shown(layer_types)}; expected a list of layer type names")


def _check_rope(value: Any, key: str, path: str) -> None:
    """rope_scaling / rope_parameters: null, or an object (Gemma 3: an object per layer type) of finite positive
    numbers, factor lists of them, and its type name."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: {key}={_shown(value)}; expected an object (or null)")
    if value and all(isinstance(v, dict) for v in value.values()):  # per layer type
        for layer_type, inner in value.items():
            _check_rope(inner, f"{key}.{layer_type}", path)
        return
    for name in _ROPE_NUMBERS:
        _positive(value.get(name), f"{key}.{name}", path)
    for name in ("original_max_position_embeddings",):
        if value.get(name) is not None and not (_is_int(value[name]) and 1 <= value[name] <= MAX_CONTEXT_LENGTH):
            raise ModelLoadError(f"{path}: {key}.{name}={value[name]!r}; expected 1 to {MAX_CONTEXT_LENGTH} tokens")
    for name in ("short_factor", "long_factor"):
        factors = value.get(name)
        if factors is not None and not (isinstance(factors, list) and all(_finite_positive(f) for f in factors)):
            raise ModelLoadError(f"{path}: {key}.{name}={_shown(factors)}; expected a list of finite positive numbers")
    for name in ("rope_type", "type"):
        if value.get(name) is not None and not isinstance(value[name], str):
            raise ModelLoadError(f"{path}: {key}.{name}={value[name]!r}; expected a rope type name")
    if value.get("truncate") is not None and not isinstance(value["truncate"], bool):
        raise ModelLoadError(f"{path}: {key}.truncate={value['truncate']!r}; expected true or false")


def _int(config: dict[str, Any], key: str, low: int, high: int, path: str) -> None:
    value = config.get(key)
    if value is not None and not (_is_int(value) and low <= value <= high):
        raise ModelLoadError(f"{path}: {key}={_shown(value)}; expected an integer from {low} to {high}")


def _positive(value: Any, key: str, path: str, high: float = MAX_SCALE) -> None:
    if value is not None and not (_finite_positive(value) and value <= high):
        raise ModelLoadError(f"{path}: {key}={value!r}; expected a finite number above 0 (up to {high:g})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else f"{text[:80]}..."
