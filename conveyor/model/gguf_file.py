"""A GGUF file's metadata and tensor views, read fast and trusting nothing.

The `gguf` package's `GGUFReader` builds a numpy view per metadata value: for a tokenizer of 49,152 tokens and
48,900 merges that is ~1 million memmap slices, seconds of every load (every server start, every `LLM()`).
Here the header is walked once with `struct` over the file's memory map, array values are decoded in bulk, and
each tensor is a numpy view of the map shaped as `GGUFReader` shapes it (float and integer types in their own
dtype, block types as uint8 `[..., row bytes]`), so the loader code reads both alike. The type tables
(`GGUFValueType`, `GGMLQuantizationType`, `GGML_QUANT_SIZES`) are the gguf package's.

A model file is untrusted input. Every count and length is bounded by the bytes left in the file before it is
used (no loop runs, and no buffer is sized, on a number the file merely claims), and an error message is built
only when it is raised. The tensor table is checked against llama.cpp's rules (`gguf_layout.py`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType

from conveyor.model.gguf_layout import (
    DEFAULT_ALIGNMENT,
    GGUFFormatError,
    GGUFTensor,
    TensorInfo,
    alignment_of,
    tensor_views,
)

__all__ = ["DEFAULT_ALIGNMENT", "GGUFFile", "GGUFFormatError", "GGUFTensor", "read_gguf"]

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
SUPPORTED_VERSIONS = (2, 3)
MAX_KEY_BYTES = 65535
"""The GGUF specification's bound on a metadata key."""
MAX_NAME_BYTES = 63
"""llama.cpp's bound on a tensor name (GGML_MAX_NAME, 64, less the terminating NUL)."""
MAX_DIMS = 4
"""llama.cpp's bound on a tensor's rank (GGML_MAX_DIMS)."""
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, the value type, a 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, a 1-byte name, rank, one dimension, type, offset

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


class _Truncated(Exception):
    """Internal: a read ran past the end of the file (the caller names what it was reading)."""


@dataclass(frozen=True)
class GGUFFile:
    path: str
    version: int
    fields: dict[str, Any]
    """Every metadata key -> its value: int / float / bool / str, or a list of them for an array."""
    tensors: list[GGUFTensor]
    data_offset: int
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    """Every metadata key -> its GGUF value type, and for an array the type of its elements."""
    metadata_end: int
    """Where the metadata ends (and the tensor table begins): the bytes before it decide the tokenizer."""

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    """Reads little-endian values from a buffer, advancing an offset; running off the end raises _Truncated."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.offset, self.size = buffer, 0, len(buffer)

    def unpack(self, code: str) -> Any:
        try:
            (value,) = struct.unpack_from(code, self.buffer, self.offset)
        except struct.error:
            raise _Truncated from None
        self.offset += struct.calcsize(code)
        return value

    def left(self) -> int:
        return self.size - self.offset

    def raw(self, length: int) -> bytes:
        if length > self.left():
            raise _Truncated
        raw = bytes(self.buffer[self.offset : self.offset + length])
        self.offset += length
        return raw

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a tokenizer's tokens and merges: ~100k of them), in one tight loop; invalid
        UTF-8 is replaced, as `GGUFReader` does (tokenizer pieces may be raw bytes)."""
        buffer, offset, size, values = self.buffer, self.offset, self.size, []
        try:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", buffer, offset)
                end = offset + 8 + length
                if end > size:
                    raise struct.error
                values.append(str(buffer[offset + 8 : end], "utf-8", "replace"))
                offset = end
        except struct.error:
            self.offset = offset
            raise _Truncated from None
        self.offset = offset
        return values


class _MetadataReader:
    """Reads one metadata value at a time; `key` names the entry in every error."""

    def __init__(self, cursor: _Cursor, path: str) -> None:
        self.cursor, self.path = cursor, path

    def error(self, key: str, problem: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: metadata {key!r} {problem}")

    def value_type(self, key: str, kind: int) -> GGUFValueType:
        try:
            return GGUFValueType(kind)
        except ValueError:
            raise self.error(key, f"has value type {kind}, which is not a GGUF type (0 to 12)") from None

    def value(self, key: str, value_type: GGUFValueType) -> tuple[Any, GGUFValueType | None]:
        """The value, and for an array the type of its elements."""
        cursor = self.cursor
        if value_type == GGUFValueType.STRING:
            length = cursor.unpack("<Q")
            if length > cursor.left():
                raise self.error(key, f"claims a string of {length} bytes, but only {cursor.left()} bytes remain")
            return str(cursor.raw(length), "utf-8", "replace"), None
        if value_type != GGUFValueType.ARRAY:
            return cursor.unpack(_SCALARS[value_type][0]), None
        element = self.value_type(key, cursor.unpack("<I"))
        count = cursor.unpack("<Q")
        if element == GGUFValueType.ARRAY:
            raise self.error(key, "is an array of arrays; GGUF readers (llama.cpp's too) support flat arrays only")
        smallest = 8 if element == GGUFValueType.STRING else _SCALARS[element][1].itemsize
        if count > cursor.left() // smallest:
            raise self.error(
                key,
                f"claims {count} {element.name} values, but only {cursor.left()} bytes remain "
                f"(each value takes at least {smallest})",
            )
        if element == GGUFValueType.STRING:
            return cursor.strings(count), element
        dtype = _SCALARS[element][1]
        values = np.frombuffer(cursor.buffer, dtype=dtype, count=count, offset=cursor.offset).tolist()
        cursor.offset += count * dtype.itemsize
        return values, element


def read_gguf(path: str) -> GGUFFile:
    """Open `path` (memory-mapped, copy-on-write, never written) and read its metadata and tensor table."""
    size = os.path.getsize(path)
    if size == 0:
        raise GGUFFormatError(f"{path}: the file is empty (0 bytes); it is truncated or not a GGUF file")
    mapped = np.memmap(path, mode="c")
    cursor = _Cursor(mapped.data)  # the map's bytes as a memoryview
    try:
        magic = cursor.unpack("<I")
    except _Truncated:
        raise GGUFFormatError(f"{path}: the file has {size} bytes, too few for a header; it is truncated") from None
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: starts with {struct.pack('<I', magic)!r}, not b'GGUF': not a GGUF file")
    if size < _HEADER_BYTES:
        raise GGUFFormatError(
            f"{path}: the file has {size} bytes, fewer than a GGUF header's {_HEADER_BYTES}; it is truncated"
        )
    version = cursor.unpack("<I")
    if version not in SUPPORTED_VERSIONS:
        order = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFFormatError(
            f"{path}: GGUF version {version}{order} is not supported; supported versions: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))} (little-endian)"
        )
    tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    room = size - _HEADER_BYTES
    for count, what, smallest in (
        (kv_count, "metadata entries", _MIN_KV_BYTES),
        (tensor_count, "tensors", _MIN_TENSOR_INFO_BYTES),
    ):
        if count > room // smallest:
            raise GGUFFormatError(
                f"{path}: the header claims {count} {what}, but a file of {size} bytes holds at most "
                f"{room // smallest} (each takes at least {smallest} bytes); the file is truncated or its "
                f"header corrupt"
            )
    fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    _read_metadata(cursor, path, kv_count, fields, value_types)
    metadata_end = cursor.offset
    infos = _read_tensor_infos(cursor, path, tensor_count)
    alignment = alignment_of(path, fields.get("general.alignment"), value_types.get("general.alignment"))
    data_offset = -(-cursor.offset // alignment) * alignment
    tensors = tensor_views(mapped, path, data_offset, alignment, [TensorInfo(*info) for info in infos])
    return GGUFFile(path, version, fields, tensors, data_offset, value_types, metadata_end)


def _read_metadata(
    cursor: _Cursor,
    path: str,
    kv_count: int,
    fields: dict[str, Any],
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]],
) -> None:
    reader = _MetadataReader(cursor, path)
    index, key = 0, ""
    try:
        for index in range(kv_count):
            key = ""
            length = cursor.unpack("<Q")
            if length == 0 or length > MAX_KEY_BYTES or length > cursor.left():
                raise GGUFFormatError(
                    f"{path}: metadata entry {index} (at byte {cursor.offset - 8}) has a key of {length} bytes; "
                    f"expected 1 to {MAX_KEY_BYTES} bytes within the file ({cursor.left()} bytes remain)"
                )
            raw = cursor.raw(length)
            if not raw.isascii():
                raise GGUFFormatError(
                    f"{path}: metadata entry {index} has the key {raw[:80]!r}, which is not ASCII (GGUF keys are)"
                )
            key = raw.decode("ascii")
            if key in fields:
                raise GGUFFormatError(f"{path}: metadata key {key!r} appears twice")
            value_type = reader.value_type(key, cursor.unpack("<I"))
            fields[key], element = reader.value(key, value_type)
            value_types[key] = (value_type, element)
    except _Truncated:
        inside = f"the value of metadata key {key!r}" if key else f"metadata entry {index}"
        raise GGUFFormatError(
            f"{path}: the file ends (at {cursor.size} bytes) inside {inside}; it is truncated or corrupt"
        ) from None


def _read_tensor_infos(cursor: _Cursor, path: str, tensor_count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape, type id, offset) of each tensor, as the table lists them; names and ranks bounded."""
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    seen: set[str] = set()
    index, name = 0, ""
    try:
        for index in range(tensor_count):
            name = ""
            length = cursor.unpack("<Q")
            if length == 0 or length > MAX_NAME_BYTES:
                raise GGUFFormatError(
                    f"{path}: tensor {index} (at byte {cursor.offset - 8}) has a name of {length} bytes; expected "
                    f"1 to {MAX_NAME_BYTES} (llama.cpp's limit)"
                )
            raw = cursor.raw(length)
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise GGUFFormatError(f"{path}: tensor {index} has the name {raw!r}, which is not UTF-8") from None
            if name in seen:
                raise GGUFFormatError(f"{path}: tensor name {name!r} appears twice")
            seen.add(name)
            n_dims = cursor.unpack("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(
                    f"{path}: tensor {name!r} has {n_dims} dimensions; expected 1 to {MAX_DIMS} (llama.cpp's limit)"
                )
            shape = _unpack_many(cursor, n_dims)
            kind = cursor.unpack("<I")
            offset = cursor.unpack("<Q")
            infos.append((name, shape, kind, offset))
    except _Truncated:
        inside = f"the entry of tensor {name!r}" if name else f"tensor entry {index}"
        raise GGUFFormatError(
            f"{path}: the file ends (at {cursor.size} bytes) inside {inside} of the tensor table; it is truncated "
            f"or corrupt"
        ) from None
    return infos


def _unpack_many(cursor: _Cursor, count: int) -> tuple[int, ...]:
    try:
        values = struct.unpack_from(f"<{count}Q", cursor.buffer, cursor.offset)
    except struct.error:
        raise _Truncated from None
    cursor.offset += 8 * count
    return tuple(values)
