"""`conveyor inspect PATH`: what a GGUF file or Hugging Face folder is, and whether Conveyor runs it, read from its
metadata and tensor headers only (no weights are loaded)."""

from __future__ import annotations

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
    """Every check a load makes short of reading the weights' values: the file's layout, metadata, spec, each
    tensor's name, type and shape, the set of tensors (fused as shape-only tensors) and the tokenizer (built, or
    found in the cache a load uses)."""
    import torch

    from conveyor.model.gguf_loader import GGUF_ARCHITECTURES, ROPE_TENSORS, check_gguf, hf_name, open_gguf
    from conveyor.model.gguf_tokenizer import load_gguf_tokenizer
    from conveyor.model.weights import fuse_weights

    try:
        reader = open_gguf(path)
    except ModelLoadError as exc:
        return ModelSummary(path, "gguf", "?", False, str(exc))
    arch = str(reader.field("general.architecture", "?"))[:80]
    types = Counter(t.tensor_type.name for t in reader.tensors)
    facts = {"tensors": f"{len(reader.tensors)} ({', '.join(f'{n} {k}' for k, n in types.most_common())})"}
    try:
        spec = check_gguf(reader, path)
    except ModelLoadError as exc:
        if arch not in GGUF_ARCHITECTURES:
            facts.update(_raw_gguf_facts(reader, arch))
        return ModelSummary(path, "gguf", arch, False, str(exc), facts)
    facts.update(_spec_facts(spec))
    shapes = {
        name: torch.empty(tuple(reversed(t.shape)), device="meta")
        for t in reader.tensors
        if t.name not in ROPE_TENSORS and (name := hf_name(t.name, arch)) is not None
    }
    try:
        fuse_weights(spec, shapes, torch.float32, path)
        load_gguf_tokenizer(path, reader)
    except ModelLoadError as exc:
        return ModelSummary(path, "gguf", arch, False, str(exc), facts)
    return ModelSummary(path, "gguf", arch, True, "", facts)


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
    from conveyor.model.hf_config_values import read_json
    from conveyor.model.hf_loader import load_hf_tokenizer, read_hf_config

    config_path = os.path.join(path, "config.json")
    config: dict[str, Any] = {}
    try:
        config = read_json(config_path) if os.path.isfile(config_path) else {}
    except ModelLoadError:
        pass  # read_hf_config says what is wrong with it
    archs = config.get("architectures")
    arch = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "?"
    facts: dict[str, str] = {}
    try:
        facts["weights"] = _safetensors_types(path)
        spec = read_hf_config(path)
    except ModelLoadError as exc:
        for key, name in (
            ("num_hidden_layers", "layers"),
            ("hidden_size", "hidden"),
            ("max_position_embeddings", "context"),
            ("sliding_window", "window"),
        ):
            if config.get(key) is not None:
                facts[name] = str(config[key])[:80]
        return ModelSummary(path, "hf-folder", arch, False, str(exc), facts)
    facts.update(_spec_facts(spec))
    try:
        _check_tensors(path, spec)
        load_hf_tokenizer(path)
    except ModelLoadError as exc:
        return ModelSummary(path, "hf-folder", arch, False, str(exc), facts)
    return ModelSummary(path, "hf-folder", arch, True, "", facts)


def _check_tensors(path: str, spec: ModelSpec) -> None:
    """Runs the loader's checks over the safetensors headers and its fusing over shape-only (meta) tensors built
    from them: a missing, unknown or mis-shaped tensor is refused exactly as a load would, without reading any
    weight."""
    import torch

    from conveyor.model.hf_loader import HF_NORM_OFFSETS, spec_for_tensors
    from conveyor.model.safetensors_files import check_entries, read_headers
    from conveyor.model.weights import fuse_weights

    entries = read_headers(sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")))
    spec = spec_for_tensors(spec, entries)
    check_entries(spec, entries)
    tensors = {name: torch.empty(entry.shape, device="meta") for name, entry in entries.items()}
    fuse_weights(spec, tensors, torch.float32, path, HF_NORM_OFFSETS.get(spec.architecture, 0.0))


def _safetensors_types(path: str) -> str:
    """'N tensors (dtype counts)' from the checked safetensors headers (no tensor data read)."""
    from conveyor.model.safetensors_files import read_headers

    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        return "no *.safetensors files"
    types = Counter(entry.dtype for entry in read_headers(files).values())
    return f"{sum(types.values())} ({', '.join(f'{n} {k}' for k, n in types.most_common())}) in {len(files)} file(s)"
