"""GGUF files: metadata -> ModelSpec; weights of the types in gguf_quant.FORMATS kept in their blocks,
the rest dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of Llama's Q and K projections so that rotary
pairs are adjacent (interleaved rope). We undo that permutation, so every format ends in
Hugging Face's layout and one rotary implementation (rotate-half) serves all.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, overload

import numpy as np
import torch

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_file import GGUFFile, GGUFFormatError, GGUFTensor, read_gguf
from conveyor.model.gguf_metadata import check_metadata
from conveyor.model.gguf_quant import FORMATS, QuantizedWeight
from conveyor.model.gguf_tokenizer import load_gguf_tokenizer
from conveyor.model.model_checks import check_finite, check_finite_blocks, check_shape, check_spec
from conveyor.model.model_spec import ModelSpec, RopeSpec
from conveyor.model.rope import yarn_attention_factor
from conveyor.model.weights import LoadedModel, fuse_weights

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


_GEMMA2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # normalises the attention output
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate and up stacked
}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = {"gemma2": _GEMMA2_LAYER_NAMES, "gemma3": _GEMMA2_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}.get(
        arch, _LAYER_NAMES
    )
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


@overload
def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray: ...
@overload
def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor: ...
def unpermute_rows(weight: np.ndarray | torch.Tensor, num_heads: int) -> np.ndarray | torch.Tensor:
    """Undo llama.cpp's per-head row interleaving of a Q or K projection [rows, cols] (an array, or a tensor viewing
    the file's map)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


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


_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def tensor_array(tensor: GGUFTensor, path: str) -> np.ndarray:
    """A GGUF tensor -> float32 array in the file's logical shape [rows, cols] (dequantized); weight types the
    gguf package cannot dequantize, and integer types, are refused by name."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind.startswith("I") and not kind.startswith("IQ"):
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} has the integer type {kind}, which holds no weights "
            f"Conveyor can use; supported weight types: {', '.join(supported_weight_types())}"
        )
    try:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} has weight type {kind}, which cannot be dequantized "
            f"here; supported: {', '.join(supported_weight_types())}"
        ) from None
    return array.reshape([int(d) for d in reversed(tensor.shape)]) if array.ndim != len(tensor.shape) else array


def float_tensor_view(tensor: GGUFTensor) -> torch.Tensor | None:
    """An F32 / F16 / BF16 GGUF tensor -> a torch view of the file's memory map [rows, cols] (no copy); None for
    every other type."""
    kind = tensor.tensor_type.name
    if kind not in ("F32", "F16", "BF16"):
        return None
    data = tensor.data
    if kind == "BF16":  # the reader gives raw bytes [..., 2 * cols]; reinterpret them as bfloat16
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(data)


@functools.cache
def supported_weight_types() -> tuple[str, ...]:
    """GGML weight types this loader reads: the float types and every type `gguf` dequantizes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    names = []
    for kind in GGMLQuantizationType:
        if kind.name in _FLOAT_TYPES:
            names.append(kind.name)
            continue
        if kind.name.startswith("I") and not kind.name.startswith("IQ"):
            continue
        block, size = GGML_QUANT_SIZES[kind]
        try:
            dequantize(np.zeros((1, 256 // block * size), dtype=np.uint8), kind)
        except NotImplementedError:
            continue
        names.append(kind.name)
    return tuple(names)


def open_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensor views (its memory map, never written); a bad file is a ModelLoadError."""
    try:
        return read_gguf(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"not a readable GGUF file: {exc}") from None
    except (OSError, ValueError) as exc:  # unreadable, or a map numpy refuses
        raise ModelLoadError(f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None


def prepare_gguf(path: str) -> tuple[GGUFFile, ModelSpec]:
    """Every check that needs no tensor data (`conveyor inspect` runs the same): the file's layout (read_gguf),
    then check_gguf."""
    reader = open_gguf(path)
    return reader, check_gguf(reader, path)


def check_gguf(reader: GGUFFile, path: str) -> ModelSpec:
    """The metadata and spec (read_spec), and each tensor's name, type and shape against the spec."""
    spec = read_spec(reader, path)
    supported = supported_weight_types()
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue  # read into spec.rope (their lengths checked there)
        name = hf_name(t.name, spec.architecture)
        if name is None:
            raise ModelLoadError(
                f"{path}: GGUF tensor {t.name!r} is not one Conveyor knows for {spec.architecture} "
                f"(skipping it would silently change the model); supported: token_embd, output, "
                f"output_norm, {', '.join(n.split('.')[0] for n in ROPE_TENSORS)} and "
                f"blk.N.{{{', '.join(_LAYER_NAMES)}}}"
            )
        if t.tensor_type.name not in supported:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has weight type {t.tensor_type.name}, which Conveyor cannot read; "
                f"supported: {', '.join(supported)}"
            )
        check_shape(spec, name, tuple(reversed(t.shape)), path, shown=t.name)
    return spec


def load_gguf(path: str, dtype: torch.dtype) -> LoadedModel:
    reader, spec = prepare_gguf(path)
    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    for t in reader.tensors:
        name = hf_name(t.name, spec.architecture)
        if name is None:
            continue  # a rope tensor, read into spec.rope
        compact = t.tensor_type.name in FORMATS and len(t.shape) == 2
        # the tensor's rows: its blocks [rows, row bytes], else a view of the file's map (F32 / F16 / BF16, cast once
        # in fuse_weights), else its values dequantized to float32
        array = np.asarray(t.data) if compact else float_tensor_view(t)
        if array is None:
            array = tensor_array(t, path)
        if spec.architecture == "llama" and name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        ):
            heads = spec.num_heads if "q_proj" in name else spec.num_kv_heads
            array = unpermute_rows(array, heads)  # whole rows move: the same for blocks
        if compact:
            blocks = torch.from_numpy(np.array(array, dtype=np.uint8, order="C", copy=True))  # [rows, row bytes]
            check_finite_blocks(t.tensor_type.name, blocks, t.name, path)
            tensors[name] = QuantizedWeight(t.tensor_type.name, blocks, int(t.shape[0]))
        else:
            tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.asarray(array))
            check_finite(tensor, t.name, path)
            tensors[name] = (
                tensor.contiguous()
                if isinstance(array, torch.Tensor)
                else torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
            )
    weights = fuse_weights(spec, tensors, dtype, path)
    return LoadedModel(spec=spec, weights=weights, tokenizer=load_gguf_tokenizer(path, reader), source=path)
