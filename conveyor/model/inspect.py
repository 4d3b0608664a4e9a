"""`conveyor inspect PATH`: what a GGUF file or Hugging Face folder is, and whether Conveyor runs it, read from its
metadata and tensor headers only (no weights are loaded)."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.errors import ModelLoadError
from conveyor.model.model_spec import ModelSpec, RopeSpec

if TYPE_CHECKING:
    from conveyor.model.gguf_file import GGUFFile


@dataclass
class ModelSummary:
    source: str
    format: str
    """'gguf' or 'hf-folder'."""
    architecture: str
    runs: bool
    reason: str = ""
    """Why Conveyor refuses it (empty when it runs)."""
    facts: dict[str, str] = field(default_factory=dict)
    """Sizes, weight types, context, rope, windows: name -> text, in display order."""

    def render(self) -> str:
        lines = [f"{self.source}", f"  format        {self.format}", f"  architecture  {self.architecture}"]
        lines += [f"  {name:<13} {value}" for name, value in self.facts.items()]
        lines.append("  conveyor      runs it" if self.runs else f"  conveyor      refuses it: {self.reason}")
        return "\n".join(lines)


def inspect_model(path: str) -> ModelSummary:
    path = os.path.expanduser(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _inspect_gguf(path)
    if os.path.isdir(path):
        return _inspect_folder(path)
    raise ModelLoadError(
        f"{path!r} is neither a .gguf file nor a folder; pass a GGUF file or a Hugging Face checkpoint folder"
    )


def _rope_text(rope: RopeSpec) -> str:
    if rope.freq_factors is not None:
        return f"theta {rope.theta:g}, per-frequency factors (llama3 scaling from rope_freqs)"
    text = f"theta {rope.theta:g}, scaling {rope.scaling_type}"
    if rope.scaling_type != "default":
        text += f" x{rope.factor:g}"
        if rope.scaling_type in ("llama3", "yarn", "longrope"):
            text += f" from {rope.original_max_position_embeddings} tokens"
        if rope.scaling_type == "longrope":
            text += " (long factors when max_model_len exceeds it, else short)"
    if rope.rotary_dim is not None:
        text += f"; rotary on {rope.rotary_dim} dimensions per head (partial)"
    return text


def _spec_facts(spec: ModelSpec) -> dict[str, str]:
    windows = sorted({w for w in spec.layer_windows if w is not None})
    if not windows:
        window_text = "none (every layer attends fully)"
    else:
        local = sum(1 for w in spec.layer_windows if w is not None)
        window_text = f"{'/'.join(map(str, windows))} tokens on {local} of {spec.num_layers} layers"
        window_text += (
            "; blocks behind the window are freed while a request runs"
            if spec.kv_window
            else "; full-attention layers keep every block"
        )
    return {
        "layers": str(spec.num_layers),
        "hidden": str(spec.hidden_size),
        "mlp": str(spec.intermediate_size),
        "heads": f"{spec.num_heads} query, {spec.num_kv_heads} key/value, head size {spec.head_dim}",
        "vocab": str(spec.vocab_size),
        "context": f"{spec.max_position_embeddings} tokens",
        "rope": _rope_text(spec.rope),
        **({"local rope": _rope_text(spec.local_rope)} if spec.local_rope is not None else {}),
        "window": window_text,
        "extras": ", ".join(
            name
            for name, on in (
                ("qkv bias", spec.qkv_bias),
                ("q/k norm", spec.qk_norm),
                ("tied embeddings", spec.tie_word_embeddings),
            )
            if on
        )
        or "none",
    }


def _inspect_gguf(path: str) -> ModelSummary:
    from conveyor.model.gguf_loader import (
        GGUF_ARCHITECTURES,
        ROPE_TENSORS,
        hf_name,
        open_gguf,
        read_spec,
        supported_weight_types,
    )

    reader = open_gguf(path)
    arch = str(reader.field("general.architecture", "?"))
    types = Counter(t.tensor_type.name for t in reader.tensors)
    facts = {"tensors": f"{len(reader.tensors)} ({', '.join(f'{n} {k}' for k, n in types.most_common())})"}
    try:
        spec = read_spec(reader, path)
    except ModelLoadError as exc:
        if arch not in GGUF_ARCHITECTURES:
            facts.update(_raw_gguf_facts(reader, arch))
        return ModelSummary(path, "gguf", arch, False, str(exc), facts)
    facts.update(_spec_facts(spec))
    supported = set(supported_weight_types())
    unknown = [t.name for t in reader.tensors if t.name not in ROPE_TENSORS and hf_name(t.name, arch) is None]
    bad_types = sorted(k for k in types if k not in supported)
    reason = ""
    if unknown:
        reason = f"tensors Conveyor does not know for {arch}: {unknown[:5]}"
    elif bad_types:
        reason = f"weight types Conveyor cannot read: {bad_types}"
    return ModelSummary(path, "gguf", arch, not reason, reason, facts)


def _raw_gguf_facts(reader: GGUFFile, arch: str) -> dict[str, str]:
    facts = {}
    for key, name in (
        ("block_count", "layers"),
        ("embedding_length", "hidden"),
        ("context_length", "context"),
        ("attention.sliding_window", "window"),
    ):
        value = reader.field(f"{arch}.{key}")
        if value is not None:
            facts[name] = str(value)
    return facts


def _inspect_folder(path: str) -> ModelSummary:
    from conveyor.model.hf_loader import read_hf_config

    config_path = os.path.join(path, "config.json")
    config: dict[str, Any] = {}
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
    arch = ", ".join(config.get("architectures") or ["?"])
    facts = {"weights": _safetensors_types(path)}
    try:
        spec = read_hf_config(path)
    except ModelLoadError as exc:
        for key, name in (
            ("num_hidden_layers", "layers"),
            ("hidden_size", "hidden"),
            ("max_position_embeddings", "context"),
            ("sliding_window", "window"),
        ):
            if config.get(key) is not None:
                facts[name] = str(config[key])
        return ModelSummary(path, "hf-folder", arch, False, str(exc), facts)
    facts.update(_spec_facts(spec))
    try:
        _check_tensor_names(path, spec)
    except ModelLoadError as exc:
        return ModelSummary(path, "hf-folder", arch, False, str(exc), facts)
    return ModelSummary(path, "hf-folder", arch, True, "", facts)


def _check_tensor_names(path: str, spec: ModelSpec) -> None:
    """Runs the loader's fusing over shape-only (meta) tensors built from the safetensors headers: a missing,
    unknown or mis-shaped tensor is refused exactly as a load would, without reading any weight."""
    import torch
    from safetensors import safe_open

    from conveyor.model.hf_loader import HF_NORM_OFFSETS, spec_for_tensors
    from conveyor.model.loader import fuse_weights

    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle has keys() but no __iter__
                tensors[key] = torch.empty(f.get_slice(key).get_shape(), device="meta")
    fuse_weights(
        spec_for_tensors(spec, tensors), tensors, torch.float32, path, HF_NORM_OFFSETS.get(spec.architecture, 0.0)
    )


def _safetensors_types(path: str) -> str:
    """'N tensors (dtype counts)' from the safetensors headers (no tensor data read)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        return "no *.safetensors files"
    types: Counter[str] = Counter()
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle has keys() but no __iter__
                types[str(f.get_slice(key).get_dtype())] += 1
    return f"{sum(types.values())} ({', '.join(f'{n} {k}' for k, n in types.most_common())}) in {len(files)} file(s)"
