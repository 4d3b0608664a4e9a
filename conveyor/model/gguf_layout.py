"""A GGUF file's tensor table checked as llama.cpp checks it, and each tensor's view of the file's map (below the
reader, gguf_file.py, which walks the header).

llama.cpp (ggml's gguf.cpp) lays the tensor data out in table order: the first tensor at the start of the data
section, each next one where the one before it ends, padded to the file's alignment. A file is accepted only in
that layout, so every tensor is aligned, inside the file, overlaps no other, and its byte size is exactly what its
type and shape require (the next tensor's offset pins it). Also checked: the type is a GGML type with a block size,
every dimension is at least 1, a row is whole blocks, and the data section ends at the end of the file (within the
last tensor's padding).

Stricter than llama.cpp, on purpose: a dimension of 0 (an empty tensor; no model has one) and bytes after the data
section (llama.cpp ignores them; a shifted header or a changed general.alignment leaves them) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands; the message says where and why."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """GGUF order: the row length (ne[0]) first."""
    n_bytes: int
    data_offset: int
    data: np.ndarray
    """A view of the file's map: [..., rows, cols] in the element dtype, or uint8 [..., rows, row bytes]."""


_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
"""Tensor types held one element per value; every other type is blocks, viewed as bytes."""


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]
    """GGUF order: the row length (ne[0]) first."""
    kind: int
    """The GGML type id, as the file states it."""
    offset: int
    """From the start of the data section."""


def alignment_of(path: str, value: Any, types: tuple[GGUFValueType, GGUFValueType | None] | None) -> int:
    """general.alignment: absent (32), else a UINT32 power of two, as llama.cpp requires."""
    if value is None:
        return DEFAULT_ALIGNMENT
    if types != (GGUFValueType.UINT32, None) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        kind = types[0].name if types else "?"
        raise GGUFFormatError(
            f"{path}: general.alignment={value!r} ({kind}); expected a UINT32 power of two (llama.cpp's rule)"
        )
    return value


def tensor_views(
    mapped: np.ndarray, path: str, data_offset: int, alignment: int, infos: list[TensorInfo]
) -> list[GGUFTensor]:
    """Each tensor's view of the map, after every check in the module docstring."""
    size = int(mapped.shape[0])
    room = max(size - data_offset, 0)
    expected, previous = 0, ""
    tensors = []
    for info in infos:
        tensor_type, n_bytes = _type_and_bytes(path, info, room)
        if info.offset != expected:
            after = f"right after {previous!r}, padded to the alignment {alignment}" if previous else "at 0"
            raise GGUFFormatError(
                f"{path}: tensor {info.name!r} starts at offset {info.offset} of the data section; llama.cpp's "
                f"layout puts it at {expected} ({after}): its data would overlap another tensor's, leave a gap or "
                f"be misaligned"
            )
        start = data_offset + info.offset
        if start + n_bytes > size:
            raise GGUFFormatError(
                f"{path}: tensor {info.name!r} ({n_bytes} bytes at {start}) runs past the end of the file "
                f"({size} bytes); it is truncated"
            )
        tensors.append(_view(mapped, info, tensor_type, start, n_bytes))
        expected, previous = info.offset + -(-n_bytes // alignment) * alignment, info.name
    if infos and size > data_offset + expected:
        raise GGUFFormatError(
            f"{path}: the file has {size - data_offset - expected} bytes after its last tensor's data (which "
            f"ends, padded to the alignment {alignment}, at byte {data_offset + expected}); the tensor table, "
            f"general.alignment or the data do not match"
        )
    return tensors


def _type_and_bytes(path: str, info: TensorInfo, room: int) -> tuple[GGMLQuantizationType, int]:
    try:
        tensor_type = GGMLQuantizationType(info.kind)
    except ValueError:
        raise GGUFFormatError(
            f"{path}: tensor {info.name!r} has type {info.kind}, which is not a GGML type this gguf package knows"
        ) from None
    if tensor_type not in GGML_QUANT_SIZES:
        raise GGUFFormatError(f"{path}: tensor {info.name!r} has type {tensor_type.name}, which has no block size")
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    if min(info.shape) < 1:
        raise GGUFFormatError(
            f"{path}: tensor {info.name!r} has shape {list(info.shape)}; every dimension must be at least 1"
        )
    if info.shape[0] % block_size:
        raise GGUFFormatError(
            f"{path}: tensor {info.name!r} rows of {info.shape[0]} values are not whole {tensor_type.name} "
            f"blocks of {block_size}"
        )
    elements = 1
    for dim in info.shape:
        elements *= dim
        if elements > 8 * room:  # every GGML type takes more than 1/8 byte per value
            elements = -1
            break
    n_bytes = elements // block_size * type_size if elements > 0 else -1
    if n_bytes < 0 or n_bytes > room:
        raise GGUFFormatError(
            f"{path}: tensor {info.name!r} ({tensor_type.name}, shape {list(info.shape)}) needs more bytes than the "
            f"file's data section holds ({room})"
        )
    return tensor_type, n_bytes


def _view(
    mapped: np.ndarray, info: TensorInfo, tensor_type: GGMLQuantizationType, start: int, n_bytes: int
) -> GGUFTensor:
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    logical = tuple(reversed(info.shape))  # [..., rows, cols]
    element_dtype = _ELEMENT_DTYPES.get(tensor_type)
    if element_dtype is not None:
        data = mapped[start : start + n_bytes].view(element_dtype).reshape(logical)
    else:
        data = mapped[start : start + n_bytes].reshape(*logical[:-1], logical[-1] // block_size * type_size)
    return GGUFTensor(info.name, tensor_type, info.shape, n_bytes, start, data)
