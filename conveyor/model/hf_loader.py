"""Hugging Face checkpoint folders: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

import torch

from conveyor.errors import ModelLoadError
from conveyor.model.loader import LoadedModel, fuse_weights
from conveyor.model.spec import SUPPORTED_ARCHITECTURES, ModelSpec, RopeSpec

logger = logging.getLogger(__name__)


def _rope_spec(config: dict[str, Any], path: str) -> RopeSpec:
    # transformers >= 5 writes "rope_parameters"; older checkpoints have rope_theta + rope_scaling
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, scaling_type="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return RopeSpec(theta=theta, scaling_type="llama3", factor=float(merged["factor"]),
                        low_freq_factor=float(merged["low_freq_factor"]),
                        high_freq_factor=float(merged["high_freq_factor"]),
                        original_max_position_embeddings=int(merged["original_max_position_embeddings"]))
    raise ModelLoadError(f"{path}: rope scaling type {kind!r} is not supported yet; supported: default, linear, "
                         f"llama3")


def checkpoint_dtype(path: str) -> str | None:
    """The dtype a Hugging Face folder's config.json names (None for GGUF files and when absent)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as f:
        config = json.load(f)
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def read_hf_config(path: str) -> ModelSpec:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path} has no config.json; a Hugging Face checkpoint folder needs config.json and "
                             f"*.safetensors files (or pass a .gguf file)")
    with open(config_path) as f:
        config = json.load(f)
    archs = config.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{config_path}: architectures={archs} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    sliding = config.get("sliding_window")
    if sliding is not None and (arch == "mistral" or config.get("use_sliding_window", False)):
        raise ModelLoadError(f"{config_path}: sliding-window attention (sliding_window={sliding}) is not "
                             f"supported yet; use a checkpoint without it (set sliding_window to null only if "
                             f"you never exceed {sliding} tokens)")
    if config.get("mlp_bias"):
        raise ModelLoadError(f"{config_path}: mlp_bias=true is not supported yet")
    heads = int(config["num_attention_heads"])
    eos = config.get("eos_token_id")
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelSpec(
        architecture=arch, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope=_rope_spec(config, config_path),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=arch == "qwen3", bos_token_id=config.get("bos_token_id"), eos_token_ids=eos_ids,
    )


def load_hf_folder(path: str, dtype: torch.dtype) -> LoadedModel:
    from safetensors import safe_open

    spec = read_hf_config(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        found = sorted(os.listdir(path))[:10]
        raise ModelLoadError(f"{path} has no *.safetensors files (found: {found}); only safetensors weights are "
                             f"read (convert .bin checkpoints with transformers' save_pretrained)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    if spec.qkv_bias and "model.layers.0.self_attn.q_proj.bias" not in tensors:
        spec = _replace(spec, qkv_bias=False)
    weights = fuse_weights(spec, tensors.get, dtype, path)
    return LoadedModel(spec=spec, weights=weights, tokenizer=load_hf_tokenizer(path), source=path,
                       sampling_defaults=_sampling_defaults(path))


def _sampling_defaults(path: str) -> dict[str, float]:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_path):
        return {}
    with open(gen_path) as f:
        gen = json.load(f)
    if gen.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: float(gen[k]) for k in ("temperature", "top_p", "top_k") if isinstance(gen.get(k), (int, float))}


def _replace(spec: ModelSpec, **changes: Any) -> ModelSpec:
    import dataclasses
    return dataclasses.replace(spec, **changes)


def load_hf_tokenizer(path: str) -> Any | None:
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        logger.warning("%s has no tokenizer files; only token-id prompts can be used and no text is produced", path)
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"{path}: the tokenizer files could not be read ({type(exc).__name__}: {exc})") \
            from None
