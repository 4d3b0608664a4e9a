"""GGUF metadata -> ModelSpec: what llama.cpp's converter writes for each supported family, read after the metadata is
checked (gguf_metadata.py), the spec checked as a whole (model_checks.check_spec)."""

from __future__ import annotations

import dataclasses
from typing import Any

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_file import GGUFFile
from conveyor.model.gguf_metadata import check_metadata
from conveyor.model.gguf_tensors import tensor_array
from conveyor.model.model_checks import check_spec
from conveyor.model.model_spec import ModelSpec, RopeSpec
from conveyor.model.rope import yarn_attention_factor

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
_GGUF_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
"""Tensors read into the spec's rope (llama3's per-frequency factors; Phi-3's longrope sets), not weights."""
PARTIAL_ROTARY_ARCHITECTURES = ("phi3",)
"""Architectures llama.cpp rotates with rotate-half (NEOX) over the first rope.dimension_count dimensions, as
transformers does for them."""


def _rope_spec(reader: GGUFFile, arch: str, path: str, names: set[str], rotary_dim: int) -> RopeSpec:
    theta = float(reader.field(f"{arch}.rope.freq_base", 10000.0))
    scaling = reader.field(f"{arch}.rope.scaling.type", "none") or "none"
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        return _longrope_spec(reader, arch, path, names, theta, scaling, rotary_dim)
    if reader.field(f"{arch}.rope.scaling.attn_factor") is not None:
        raise ModelLoadError(
            f"{path}: GGUF metadata {arch}.rope.scaling.attn_factor without the rope_factors_long "
            f"and rope_factors_short tensors; supported: with them (Phi-3's longrope)"
        )
    if scaling not in _GGUF_ROPE_TYPES:
        raise ModelLoadError(
            f"{path}: GGUF metadata {arch}.rope.scaling.type={scaling!r} is not supported; "
            f"supported: {', '.join(_GGUF_ROPE_TYPES)} (and llama3 scaling as a rope_freqs tensor)"
        )
    if "rope_freqs.weight" in names:
        if scaling != "none":
            raise ModelLoadError(
                f"{path}: both a rope_freqs tensor and {arch}.rope.scaling.type={scaling!r}; supported: one of them"
            )
        tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = tuple(float(x) for x in tensor_array(tensor, path).reshape(-1))
        if len(factors) != rotary_dim // 2:
            raise ModelLoadError(
                f"{path}: the rope_freqs tensor has {len(factors)} factors; {rotary_dim} rotating dimensions per "
                f"head need {rotary_dim // 2}"
            )
        return RopeSpec(theta=theta, freq_factors=factors)
    factor = float(reader.field(f"{arch}.rope.scaling.factor", 1.0))
    if scaling == "none":
        return RopeSpec(theta=theta)
    if scaling == "linear":
        return RopeSpec(theta=theta, scaling_type="linear", factor=factor)
    ext_factor = reader.field(f"{arch}.rope.scaling.yarn_ext_factor")
    if ext_factor is not None and float(ext_factor) not in (-1.0, 1.0):
        raise ModelLoadError(
            f"{path}: GGUF metadata {arch}.rope.scaling.yarn_ext_factor={ext_factor} is not "
            f"supported; supported: 1.0 (transformers' YaRN)"
        )
    original = reader.field(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"{path}: yarn rope scaling without {arch}.rope.scaling.original_context_length")
    attention_factor = reader.field(f"{arch}.rope.scaling.yarn_attn_factor")
    return RopeSpec(
        theta=theta,
        scaling_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(original),
        beta_fast=float(reader.field(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(reader.field(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        attention_factor=float(attention_factor) if attention_factor is not None else yarn_attention_factor(factor),
    )


def _longrope_spec(
    reader: GGUFFile, arch: str, path: str, names: set[str], theta: float, scaling: str, rotary_dim: int
) -> RopeSpec:
    """Phi-3's longrope as llama.cpp's converter writes it: both factor sets as tensors, the attention factor and
    the original context as metadata (the set is chosen per engine, see conveyor/model/rope.py)."""
    if arch != "phi3" or scaling != "none" or not {"rope_factors_long.weight", "rope_factors_short.weight"} <= names:
        found = sorted(n for n in names if n.startswith("rope_factors"))
        raise ModelLoadError(
            f"{path}: rope_factors tensors ({found}) with architecture {arch!r} and "
            f"{arch}.rope.scaling.type={scaling!r}; supported: both rope_factors_long and "
            f"rope_factors_short, architecture phi3, no rope.scaling.type"
        )
    original = reader.field(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(
            f"{path}: rope_factors tensors without {arch}.rope.scaling.original_context_length; "
            f"longrope needs it to choose between them"
        )
    sets = {}
    for name in ("rope_factors_short.weight", "rope_factors_long.weight"):
        tensor = next(t for t in reader.tensors if t.name == name)
        sets[name] = tuple(float(x) for x in tensor_array(tensor, path).reshape(-1))
        if len(sets[name]) != rotary_dim // 2:
            raise ModelLoadError(
                f"{path}: the {name} tensor has {len(sets[name])} factors; {rotary_dim} rotating "
                f"dimensions need {rotary_dim // 2}"
            )
    context = int(reader.field(f"{arch}.context_length", original))
    return RopeSpec(
        theta=theta,
        scaling_type="longrope",
        factor=context / int(original),
        original_max_position_embeddings=int(original),
        attention_factor=float(reader.field(f"{arch}.rope.scaling.attn_factor", 1.0)),
        short_factors=sets["rope_factors_short.weight"],
        long_factors=sets["rope_factors_long.weight"],
    )


def read_spec(reader: GGUFFile, path: str) -> ModelSpec:
    arch = reader.field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    check_metadata(reader, arch, path)

    def need(key: str) -> Any:
        value = reader.field(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{key} is missing; the file is incomplete")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(reader.field(f"{arch}.attention.key_length", hidden // heads))
    value_length = reader.field(f"{arch}.attention.value_length")
    if value_length is not None and int(value_length) != head_dim:
        raise ModelLoadError(
            f"{path}: GGUF metadata {arch}.attention.value_length={value_length} differs from the "
            f"head size {head_dim}; supported: equal (distinct value sizes are not implemented)"
        )
    rotary_dim = int(reader.field(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim and (
        arch not in PARTIAL_ROTARY_ARCHITECTURES or rotary_dim % 2 or not 0 < rotary_dim < head_dim
    ):
        raise ModelLoadError(
            f"{path}: GGUF metadata {arch}.rope.dimension_count={rotary_dim} differs from the head "
            f"size {head_dim}; supported: equal, or an even part of it for "
            f"{', '.join(PARTIAL_ROTARY_ARCHITECTURES)} (partial rotary)"
        )
    names = {t.name for t in reader.tensors}
    rope = _rope_spec(reader, arch, path, names, rotary_dim)
    if rotary_dim != head_dim:
        rope = dataclasses.replace(rope, rotary_dim=rotary_dim)
    tokens = len(reader.fields["tokenizer.ggml.tokens"])  # present: check_metadata saw to it
    vocab = reader.field(f"{arch}.vocab_size", tokens)
    if tokens > vocab:
        raise ModelLoadError(
            f"{path}: GGUF metadata {arch}.vocab_size={vocab} is smaller than the tokenizer's {tokens} tokens "
            f"(tokenizer.ggml.tokens); every token needs a row of the embedding"
        )
    eos = reader.field("tokenizer.ggml.eos_token_id")
    eot = reader.field("tokenizer.ggml.eot_token_id")
    spec = ModelSpec(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(reader.field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope=rope,
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=reader.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(sorted({int(t) for t in (eos, eot) if t is not None})),
        **(_gemma2_fields(reader, hidden, heads, head_dim, int(need("block_count"))) if arch == "gemma2" else {}),
        **(_gemma3_fields(reader, hidden, heads, head_dim, int(need("block_count")), path) if arch == "gemma3" else {}),
        **(_phi3_fields(reader, int(need("block_count"))) if arch == "phi3" else {}),
    )
    check_spec(spec, path)
    return spec


def _phi3_fields(reader: GGUFFile, layers: int) -> dict[str, Any]:
    """Phi-3's sliding window covers every layer (0: none, as llama.cpp's converter writes for Phi-4)."""
    window = reader.field("phi3.attention.sliding_window")
    return dict(layer_windows=(int(window),) * layers) if window else {}


def _gemma2_fields(reader: GGUFFile, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
    """Gemma 2 as llama.cpp runs it: every other layer local (even ones, as transformers' layer_types), the
    query scale 1/sqrt(head_dim) except for the 46-layer 27B, which uses 1/sqrt(hidden / heads) (the GGUF has no
    query_pre_attn_scalar)."""
    window = reader.field("gemma2.attention.sliding_window")
    scale_dim = hidden / heads if layers == 46 else head_dim
    return dict(
        activation="gelu_tanh",
        embedding_multiplier=float(hidden) ** 0.5,
        attention_scale=scale_dim**-0.5,
        attn_logit_softcap=reader.field("gemma2.attn_logit_softcapping"),
        final_logit_softcap=reader.field("gemma2.final_logit_softcapping"),
        sandwich_norms=True,
        layer_windows=tuple(int(window) if window and i % 2 == 0 else None for i in range(layers)),
    )


GEMMA3_SLIDING_WINDOW_PATTERN = 6
"""llama.cpp's fixed Gemma 3 layer pattern (its converter writes none): five local layers, then a global one."""
GEMMA3_LOCAL_ROPE_BASE = 10000.0
"""The local layers' rope base llama.cpp assumes when the file has no gemma3.rope.freq_base_swa."""


def _gemma3_fields(reader: GGUFFile, hidden: int, heads: int, head_dim: int, layers: int, path: str) -> dict[str, Any]:
    """Gemma 3 text as llama.cpp runs it: local (sliding) and global layers by the sliding_window_pattern key
    (a period n: layer i is local when i % n < n - 1; or one flag per layer) or llama.cpp's fixed period 6, local
    layers with their own rope base and no scaling, q/k norms (tensors), the query scale 1/sqrt(head_dim) except
    for the 62-layer 27B (1/sqrt(hidden / heads)), as llama.cpp (the GGUF has no query_pre_attn_scalar)."""
    window = reader.field("gemma3.attention.sliding_window")
    if not window:
        raise ModelLoadError(
            f"{path}: GGUF metadata gemma3.attention.sliding_window is missing or 0; Gemma 3's "
            f"local layers need it (the file is incomplete)"
        )
    pattern = reader.field("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(
                f"{path}: GGUF metadata gemma3.attention.sliding_window_pattern has {len(pattern)} "
                f"flags for {layers} layers; supported: one per layer, or a period"
            )
        local = [bool(flag) for flag in pattern]
    else:
        local = [int(pattern) > 0 and i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    scale_dim = hidden / heads if layers == 62 else head_dim
    return dict(
        activation="gelu_tanh",
        embedding_multiplier=float(hidden) ** 0.5,
        attention_scale=scale_dim**-0.5,
        final_logit_softcap=reader.field("gemma3.final_logit_softcapping"),
        sandwich_norms=True,
        local_rope=RopeSpec(theta=float(reader.field("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))),
        layer_windows=tuple(int(window) if is_local else None for is_local in local),
    )
