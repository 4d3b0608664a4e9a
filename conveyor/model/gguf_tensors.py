"""A GGUF tensor's values: a torch view of the file's map for the float types, else dequantized by the `gguf`
package; which weight types those are."""

from __future__ import annotations

import functools

import numpy as np
import torch

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_file import GGUFTensor

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
