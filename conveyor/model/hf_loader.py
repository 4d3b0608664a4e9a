"""Hugging Face checkpoint folders: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from conveyor.errors import ModelLoadError
from conveyor.model.hf_config_values import check_config_values, read_json
from conveyor.model.model_checks import check_spec, check_tokenizer_works
from conveyor.model.model_spec import SUPPORTED_ARCHITECTURES, ModelSpec, RopeSpec
from conveyor.model.rope import ROPE_SCALING_TYPES, yarn_attention_factor
from conveyor.model.safetensors_files import check_entries, read_headers, read_tensors
from conveyor.model.weights import LoadedModel, fuse_weights

logger = logging.getLogger(__name__)


PARTIAL_ROTARY_ARCHITECTURES = ("phi3",)
"""Architectures whose transformers implementation rotates only partial_rotary_factor of each head."""


def _rope_spec(config: dict[str, Any], arch: str, path: str, layer_type: str | None = None) -> RopeSpec:
    # transformers >= 5 writes "rope_parameters"; older checkpoints have rope_theta + rope_scaling, which
    # transformers still prefers when both are there (checked: rope_scaling wins, rope_theta from the top level).
    # Gemma 3 keeps one set per layer type.
    merged = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if layer_type is not None:  # transformers merges a legacy rope_scaling into the global layers' set
        merged = dict((config.get("rope_parameters") or {}).get(layer_type) or {})
        if layer_type == "full_attention":
            merged.update(config.get("rope_scaling") or {})
        elif "rope_theta" not in merged and config.get("rope_local_base_freq") is not None:
            merged["rope_theta"] = config["rope_local_base_freq"]
    partial = float(merged.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    if partial == 1.0:
        return _scaled_rope_spec(config, merged, arch, path, head_dim)
    rotary_dim = int(head_dim * partial)
    if arch not in PARTIAL_ROTARY_ARCHITECTURES or not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(
            f"{path}: partial_rotary_factor={partial} (rotary on {rotary_dim} of {head_dim} "
            f"dimensions per head) is not supported for {arch}; supported: 1.0, or an even number "
            f"of rotating dimensions for {', '.join(PARTIAL_ROTARY_ARCHITECTURES)}"
        )
    return dataclasses.replace(_scaled_rope_spec(config, merged, arch, path, rotary_dim), rotary_dim=rotary_dim)


def _scaled_rope_spec(
    config: dict[str, Any], merged: dict[str, Any], arch: str, path: str, rotary_dim: int
) -> RopeSpec:
    theta = float(merged.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if arch == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # transformers reads Phi-3's older names as longrope
    if kind not in ROPE_SCALING_TYPES:
        raise ModelLoadError(
            f"{path}: rope scaling type {kind!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}"
        )

    def need(key: str) -> Any:
        if merged.get(key) is None:
            raise ModelLoadError(
                f"{path}: rope scaling {kind!r} needs {key!r} in rope_scaling / rope_parameters; found {sorted(merged)}"
            )
        return merged[key]

    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, scaling_type="linear", factor=float(need("factor")))
    original = int(
        merged.get("original_max_position_embeddings")
        or config.get("original_max_position_embeddings")
        or need("original_max_position_embeddings")
    )
    if kind == "llama3":
        return RopeSpec(
            theta=theta,
            scaling_type="llama3",
            factor=float(need("factor")),
            low_freq_factor=float(need("low_freq_factor")),
            high_freq_factor=float(need("high_freq_factor")),
            original_max_position_embeddings=original,
        )
    factor = merged.get("factor")
    factor = float(factor) if factor is not None else int(config["max_position_embeddings"]) / original
    attention_factor = merged.get("attention_factor")
    if kind == "longrope":
        return _longrope_spec(merged, theta, factor, original, attention_factor, rotary_dim, path)
    return RopeSpec(
        theta=theta,
        scaling_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=float(attention_factor)
        if attention_factor is not None
        else yarn_attention_factor(factor, merged.get("mscale"), merged.get("mscale_all_dim")),
    )


def _longrope_spec(
    merged: dict[str, Any],
    theta: float,
    factor: float,
    original: int,
    attention_factor: Any,
    rotary_dim: int,
    path: str,
) -> RopeSpec:
    """longrope as transformers computes it: both factor sets, one per rotating pair; the attention factor given,
    or sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1)."""
    sets = {}
    for key in ("short_factor", "long_factor"):
        values = merged.get(key)
        if values is None:
            raise ModelLoadError(
                f"{path}: rope scaling 'longrope' needs {key!r} in rope_scaling / rope_parameters; "
                f"found {sorted(merged)}"
            )
        if not isinstance(values, list) or len(values) != rotary_dim // 2:
            raise ModelLoadError(
                f"{path}: rope scaling 'longrope' needs {key} to be a list of {rotary_dim // 2} "
                f"numbers (one per rotating pair); found "
                f"{len(values) if isinstance(values, list) else type(values).__name__}"
            )
        sets[key] = tuple(float(v) for v in values)
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return RopeSpec(
        theta=theta,
        scaling_type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        short_factors=sets["short_factor"],
        long_factors=sets["long_factor"],
    )


_REFUSED_UNLESS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    # config.json fields that change the computation, with the values that leave it unchanged
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logit_scale": (None, 1, 1.0),
    "attention_multiplier": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "mlp_bias": (None, False),
    "query_pre_attn_scalar": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    "use_qk_norm": (None, False),
    "no_rope_layers": (None,),
}
"""Refused by name when set to anything else (these families have no such feature in Conveyor)."""


_HONOURED_BY_ARCH: dict[str, set[str]] = {
    "gemma2": {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"},
    "gemma3": {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"},
}
"""Fields of _REFUSED_UNLESS_NEUTRAL an architecture does implement (read in read_hf_config)."""
HF_NORM_OFFSETS = {"gemma2": 1.0, "gemma3": 1.0}
"""Added to the RMSNorm weights of these architectures' checkpoints (Gemma stores weight - 1)."""


def check_config_fields(config: dict[str, Any], arch: str, path: str) -> None:
    """Refuse, by name and value, every config.json field that would change the computation and is not
    honoured for this architecture."""
    act = config.get("hidden_activation", config.get("hidden_act", "silu"))
    allowed = ("gelu_pytorch_tanh",) if arch in ("gemma2", "gemma3") else ("silu",)
    if act not in allowed:
        raise ModelLoadError(
            f"{path}: hidden_act={act!r} is not supported for {arch}; supported: {', '.join(map(repr, allowed))}"
        )
    honoured = _HONOURED_BY_ARCH.get(arch, set())
    for key, neutral in _REFUSED_UNLESS_NEUTRAL.items():
        if key in config and config[key] not in neutral and key not in honoured:
            raise ModelLoadError(
                f"{path}: {key}={config[key]!r} is not supported for {arch} (Conveyor would "
                f"compute something else); supported: {key} unset or {neutral[-1]!r}"
            )
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: use_bidirectional_attention=true is not supported; supported: causal")
    layer_types = config.get("layer_types") or []
    unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ModelLoadError(f"{path}: layer_types has {unknown}; supported: full_attention, sliding_attention")


def layer_windows(config: dict[str, Any], arch: str, path: str) -> tuple[int | None, ...]:
    """Per-layer sliding windows as transformers applies them: Mistral windows every layer when sliding_window
    is set; Qwen2/Qwen3 only with use_sliding_window, on the layers layer_types (or max_window_layers) names."""
    layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if arch in ("mistral", "phi3"):  # transformers windows every layer of these when sliding_window is set
        types = ["sliding_attention"] * layers if window is not None else ["full_attention"] * layers
    elif arch in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False) or window is None:
            return ()
        first = int(config.get("max_window_layers", layers))
        types = config.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        ]
    else:
        types = config.get("layer_types") or ["full_attention"] * layers
        if "sliding_attention" in types and window is None:
            raise ModelLoadError(f"{path}: layer_types has sliding_attention but sliding_window is not set")
    if len(types) != layers:
        raise ModelLoadError(f"{path}: layer_types has {len(types)} entries for {layers} layers")
    if window is None:  # then no layer slides (each branch above sees to it)
        return ()
    if int(window) < 1:
        raise ModelLoadError(f"{path}: sliding_window={window} must be a positive number of tokens")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def checkpoint_dtype(path: str) -> str | None:
    """The dtype a Hugging Face folder's config.json names (None for GGUF files, when absent or unreadable: the
    load then says what is wrong with it)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return None
    try:
        config = read_json(config_path)
    except ModelLoadError:
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def read_hf_config(path: str) -> ModelSpec:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(
            f"{path} has no config.json; a Hugging Face checkpoint folder needs config.json and "
            f"*.safetensors files (or pass a .gguf file)"
        )
    config = read_json(config_path)
    archs = config.get("architectures") or []
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in names if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{config_path}: architectures={archs} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    check_config_values(config, config_path)
    check_config_fields(config, arch, config_path)
    try:
        spec = _read_spec(config, arch, path, config_path)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        raise ModelLoadError(
            f"{config_path}: a field has a value of the wrong kind ({type(exc).__name__}: {exc})"
        ) from None
    check_spec(spec, config_path)
    return spec


def _read_spec(config: dict[str, Any], arch: str, path: str, config_path: str) -> ModelSpec:
    heads = int(config["num_attention_heads"])
    eos = config.get("eos_token_id")
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        eos = read_json(gen_path).get("eos_token_id", eos)
    eos_ids = tuple(int(t) for t in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    bos = config.get("bos_token_id")
    return ModelSpec(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_rope_spec(config, arch, config_path, "full_attention" if arch == "gemma3" else None),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "gemma3"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        layer_windows=layer_windows(config, arch, config_path),
        **_gemma_fields(config, arch, config_path),
    )


def _gemma_fields(config: dict[str, Any], arch: str, path: str) -> dict[str, Any]:
    if arch not in ("gemma2", "gemma3"):
        return {}
    scalar = config.get("query_pre_attn_scalar")
    fields = dict(
        activation="gelu_tanh",
        embedding_multiplier=float(config["hidden_size"]) ** 0.5,
        attention_scale=float(scalar) ** -0.5 if scalar is not None else None,
        attn_logit_softcap=config.get("attn_logit_softcapping"),
        final_logit_softcap=config.get("final_logit_softcapping"),
        sandwich_norms=True,
    )
    if arch == "gemma3":  # local layers have their own rope (base rope_local_base_freq, no scaling)
        fields["local_rope"] = _rope_spec(config, arch, path, "sliding_attention")
    return fields


def load_hf_folder(path: str, dtype: torch.dtype) -> LoadedModel:
    spec = read_hf_config(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        found = sorted(os.listdir(path))[:10]
        raise ModelLoadError(
            f"{path} has no *.safetensors files (found: {found}); only safetensors weights are "
            f"read (convert .bin checkpoints with transformers' save_pretrained)"
        )
    entries = read_headers(files)
    spec = spec_for_tensors(spec, entries)
    check_entries(spec, entries)
    # The tokenizer (seconds: most of it importing transformers, in Python) loads on a thread while the weights
    # are fused (torch's ops, outside the GIL). safetensors maps each file: the tensors are views of the map.
    with ThreadPoolExecutor(1, thread_name_prefix="conveyor-tokenizer") as pool:
        tokenizer = pool.submit(load_hf_tokenizer, path)
        tensors = read_tensors(entries)
        weights = fuse_weights(spec, tensors, dtype, path, HF_NORM_OFFSETS.get(spec.architecture, 0.0))
        return LoadedModel(
            spec=spec,
            weights=weights,
            tokenizer=tokenizer.result(),
            source=path,
            sampling_defaults=_sampling_defaults(path),
        )


def _sampling_defaults(path: str) -> dict[str, float]:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_path):
        return {}
    gen = read_json(gen_path)
    if gen.get("do_sample") is False:
        return {"temperature": 0.0}
    return {
        k: float(gen[k])
        for k in ("temperature", "top_p", "top_k")
        if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool) and math.isfinite(gen[k])
    }


def spec_for_tensors(spec: ModelSpec, names: Any) -> ModelSpec:
    """The spec with what the tensor names settle: a Llama-family attention_bias config whose checkpoint has no
    q/k/v biases loads without them."""
    if spec.qkv_bias and "model.layers.0.self_attn.q_proj.bias" not in names:
        return dataclasses.replace(spec, qkv_bias=False)
    return spec


def load_hf_tokenizer(path: str) -> Any | None:
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        logger.warning("%s has no tokenizer files; only token-id prompts can be used and no text is produced", path)
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"{path}: the tokenizer files could not be read ({type(exc).__name__}: {exc})") from None
    return check_tokenizer_works(tokenizer, path)
