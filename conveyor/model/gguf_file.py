"""A GGUF file's metadata and tensor views, read fast.

The `gguf` package's `GGUFReader` builds a numpy view per metadata value: for a tokenizer of 49,152 tokens and
48,900 merges that is ~1 million memmap slices, seconds of every load (every server start, every `LLM()`).
Here the header is walked once with `struct` over the file's memory map,
array values are decoded in bulk, and each tensor is a numpy view of the map shaped as `GGUFReader` shapes it
(float and integer types in their own dtype, block types as uint8 `[..., row bytes]`), so the loader code reads
both alike. The type tables (`GGUFValueType`, `GGMLQuantizationType`, `GGML_QUANT_SIZES`) are the gguf package's.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS: dict[GGUFValueType, tuple[str, np.dtype]] = {  # struct code, numpy dtype (little endian)
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
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


@dataclass(frozen=True)
class GGUFFile:
    path: str
    version: int
    fields: dict[str, Any]
    """Every metadata key -> its value: int / float / bool / str, or a list of them for an array."""
    tensors: list[GGUFTensor]
    data_offset: int

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    """Reads little-endian values from a buffer, advancing an offset; running off the end is a format error."""

    def __init__(self, buffer: memoryview, path: str) -> None:
        self.buffer, self.path, self.offset = buffer, path, 0

    def unpack(self, code: str, what: str) -> Any:
        try:
            (value,) = struct.unpack_from(code, self.buffer, self.offset)
        except struct.error:
            raise GGUFFormatError(
                f"{self.path}: the file ends at byte {len(self.buffer)} inside {what} (offset "
                f"{self.offset}); it is truncated or not a GGUF file"
            ) from None
        self.offset += struct.calcsize(code)
        return value

    def string(self, what: str) -> str:
        length = self.unpack("<Q", what)
        end = self.offset + length
        if end > len(self.buffer):
            raise GGUFFormatError(
                f"{self.path}: {what} claims {length} bytes at offset {self.offset}, past the end "
                f"of the file ({len(self.buffer)} bytes); it is truncated or corrupt"
            )
        raw = bytes(self.buffer[self.offset : end])
        self.offset = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # tokenizer pieces may be raw bytes; GGUFReader decodes them the same way
            return raw.decode("utf-8", errors="replace")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row (a tokenizer's tokens and merges: ~100k of them), in one tight loop."""
        buffer, offset, size, values = self.buffer, self.offset, len(self.buffer), []
        try:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", buffer, offset)
                end = offset + 8 + length
                if end > size:
                    raise struct.error
                values.append(str(buffer[offset + 8 : end], "utf-8", "replace"))
                offset = end
        except struct.error:
            raise GGUFFormatError(
                f"{self.path}: {what}[{len(values)}] runs past the end of the file ({size} bytes, "
                f"at offset {offset}); it is truncated or corrupt"
            ) from None
        self.offset = offset
        return values

    def value(self, kind: int, what: str) -> Any:
        try:
            value_type = GGUFValueType(kind)
        except ValueError:
            raise GGUFFormatError(f"{self.path}: {what} has value type {kind}, which is not a GGUF type") from None
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type == GGUFValueType.ARRAY:
            return self.array(what)
        code, _ = _SCALARS[value_type]
        return self.unpack(code, what)

    def array(self, what: str) -> list[Any]:
        kind = self.unpack("<I", what)
        count = self.unpack("<Q", what)
        try:
            scalar = _SCALARS.get(GGUFValueType(kind))
        except ValueError:
            raise GGUFFormatError(f"{self.path}: {what} is an array of type {kind}, which is not a GGUF type") from None
        if kind == GGUFValueType.STRING:
            return self.strings(count, what)
        if scalar is None:  # nested arrays: one at a time
            return [self.value(kind, f"{what}[{i}]") for i in range(count)]
        dtype = scalar[1]
        end = self.offset + count * dtype.itemsize
        if end > len(self.buffer):
            raise GGUFFormatError(
                f"{self.path}: {what} claims {count} values at offset {self.offset}, past the end "
                f"of the file ({len(self.buffer)} bytes); it is truncated or corrupt"
            )
        values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset).tolist()
        self.offset = end
        return values


def read_gguf(path: str) -> GGUFFile:
    """Open `path` (memory-mapped, copy-on-write, never written) and read its metadata and tensor table."""
    if os.path.getsize(path) == 0:
        raise GGUFFormatError(f"{path}: the file is empty (0 bytes); it is truncated or not a GGUF file")
    mapped = np.memmap(path, mode="c")
    cursor = _Cursor(mapped.data, path)  # the map's bytes as a memoryview (memoryview(mapped) likewise)
    magic = cursor.unpack("<I", "the magic number")
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: starts with {struct.pack('<I', magic)!r}, not b'GGUF': not a GGUF file")
    version = cursor.unpack("<I", "the version")
    if version not in SUPPORTED_VERSIONS:
        order = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFFormatError(
            f"{path}: GGUF version {version}{order} is not supported; supported versions: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))} (little-endian)"
        )
    tensor_count = cursor.unpack("<Q", "the tensor count")
    kv_count = cursor.unpack("<Q", "the metadata count")
    fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    for i in range(kv_count):
        key = cursor.string(f"metadata key {i}")
        if key in fields:
            raise GGUFFormatError(f"{path}: metadata key {key!r} appears twice")
        fields[key] = cursor.value(cursor.unpack("<I", f"the type of {key}"), key)
    infos = []
    for i in range(tensor_count):
        name = cursor.string(f"tensor name {i}")
        n_dims = cursor.unpack("<I", f"the rank of tensor {name!r}")
        shape = tuple(cursor.unpack("<Q", f"the shape of tensor {name!r}") for _ in range(n_dims))
        kind = cursor.unpack("<I", f"the type of tensor {name!r}")
        offset = cursor.unpack("<Q", f"the offset of tensor {name!r}")
        infos.append((name, shape, kind, offset))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"{path}: general.alignment={alignment!r} is not a power of two")
    data_offset = -(-cursor.offset // alignment) * alignment
    tensors = [_tensor(mapped, path, data_offset, *info) for info in infos]
    if len({t.name for t in tensors}) != len(tensors):
        raise GGUFFormatError(f"{path}: a tensor name appears twice")
    return GGUFFile(path, version, fields, tensors, data_offset)


def _tensor(
    mapped: np.ndarray, path: str, data_offset: int, name: str, shape: tuple[int, ...], kind: int, offset: int
) -> GGUFTensor:
    try:
        tensor_type = GGMLQuantizationType(kind)
    except ValueError:
        raise GGUFFormatError(
            f"{path}: tensor {name!r} has type {kind}, which is not a GGML type this gguf package knows"
        ) from None
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[0] % block_size:
        raise GGUFFormatError(
            f"{path}: tensor {name!r} rows of {shape[0]} values are not whole {tensor_type.name} blocks of {block_size}"
        )
    n_bytes = elements // block_size * type_size
    start = data_offset + offset
    if start + n_bytes > mapped.shape[0]:
        raise GGUFFormatError(
            f"{path}: tensor {name!r} ({n_bytes} bytes at {start}) runs past the end of the file "
            f"({mapped.shape[0]} bytes); it is truncated"
        )
    logical = tuple(reversed(shape))  # [..., rows, cols]
    element_dtype = _ELEMENT_DTYPES.get(tensor_type)
    if element_dtype is not None:
        data = mapped[start : start + n_bytes].view(element_dtype).reshape(logical)
    else:
        data = mapped[start : start + n_bytes].reshape(*logical[:-1], logical[-1] // block_size * type_size)
    return GGUFTensor(name, tensor_type, shape, n_bytes, start, data)
