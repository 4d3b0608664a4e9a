"""GGUF files -> LoadedModel: the file read and checked (gguf_file.py, gguf_layout.py), its metadata and spec
(gguf_metadata.py, gguf_spec.py), each tensor's name, type and shape, then its values: weights of the types in
gguf_quant.FORMATS kept in their blocks, the rest dequantized with the `gguf` package (gguf_tensors.py), every one
checked finite.

llama.cpp's converter permutes the rows of Llama's Q and K projections so that rotary
pairs are adjacent (interleaved rope). We undo that permutation, so every format ends in
Hugging Face's layout and one rotary implementation (rotate-half) serves all.
"""

from __future__ import annotations

import logging
from typing import overload

import numpy as np
import torch

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_file import GGUFFile, GGUFFormatError, read_gguf
from conveyor.model.gguf_quant import FORMATS, QuantizedWeight
from conveyor.model.gguf_spec import GGUF_ARCHITECTURES, ROPE_TENSORS, read_spec
from conveyor.model.gguf_tensors import float_tensor_view, supported_weight_types, tensor_array
from conveyor.model.gguf_tokenizer import load_gguf_tokenizer
from conveyor.model.model_checks import check_finite, check_finite_blocks, check_shape
from conveyor.model.model_spec import ModelSpec
from conveyor.model.weights import LoadedModel, fuse_weights

__all__ = [
    "GGUF_ARCHITECTURES",
    "ROPE_TENSORS",
    "check_gguf",
    "hf_name",
    "load_gguf",
    "load_gguf_tokenizer",
    "open_gguf",
    "prepare_gguf",
    "read_spec",
    "supported_weight_types",
    "unpermute_rows",
]

logger = logging.getLogger(__name__)

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
