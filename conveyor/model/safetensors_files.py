"""A Hugging Face folder's *.safetensors files, checked before any tensor is read.

A safetensors file is an 8-byte little-endian header size N, N bytes of JSON naming each tensor's dtype, shape and
[begin, end) byte offsets into the data that follows. The header is read here with its size bounded (by the file
and by safetensors' own 100 MB limit) and every entry checked: a known float dtype, a shape of non-negative
integers, offsets whose span is exactly what the dtype and shape require, laid out back to back from the start of
the data to the end of the file (safetensors' own rule), no name twice (in a file or across files). The tensors
are then read with the safetensors library (which checks the same again), each checked finite.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from conveyor.errors import ModelLoadError
from conveyor.model.model_checks import check_finite, check_shape
from conveyor.model.model_spec import ModelSpec

MAX_HEADER_BYTES = 100_000_000
"""safetensors' own bound on the JSON header."""
WEIGHT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
"""The dtypes that hold weights Conveyor reads, with their sizes in bytes."""


class TensorEntry(NamedTuple):
    file: str
    dtype: str
    shape: tuple[int, ...]
    """Torch order: [rows, cols]."""
    begin: int
    end: int


def read_headers(files: Iterable[str]) -> dict[str, TensorEntry]:
    """Every tensor of the files, by name, from their checked headers."""
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, entry in read_header(file).items():
            if name in entries:
                raise ModelLoadError(
                    f"{file}: tensor {name!r} is also in {entries[name].file}; a checkpoint names each tensor once"
                )
            entries[name] = entry
    return entries


def read_header(file: str) -> dict[str, TensorEntry]:
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelLoadError(f"{file}: the file has {size} bytes, too few for a safetensors header size")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise ModelLoadError(
                    f"{file}: the header claims {length} bytes; expected at most {min(size - 8, MAX_HEADER_BYTES)} "
                    f"(the file's {size} bytes, safetensors' limit of {MAX_HEADER_BYTES}); truncated or corrupt"
                )
            raw = f.read(length)
    except OSError as exc:
        raise ModelLoadError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, a name twice, nested too deep
        raise ModelLoadError(f"{file}: the safetensors header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file}: the safetensors header is a JSON {type(header).__name__}; expected an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ModelLoadError(f"{file}: the header's __metadata__ is {_shown(metadata)}; expected strings by name")
    entries = {name: _entry(file, name, value) for name, value in header.items()}
    _check_layout(file, entries, size - 8 - length)
    return entries


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"the name {key!r} appears twice")
        result[key] = value
    return result


def _entry(file: str, name: str, value: Any) -> TensorEntry:
    def bad(problem: str) -> ModelLoadError:
        return ModelLoadError(f"{file}: tensor {name!r} {problem}")

    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"has the header entry {_shown(value)}; expected dtype, shape and data_offsets")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in WEIGHT_DTYPES:
        raise bad(f"has dtype {_shown(dtype)}; Conveyor reads weights of {', '.join(WEIGHT_DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"has shape {_shown(shape)}; expected a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        raise bad(f"has data_offsets {_shown(offsets)}; expected [begin, end], two non-negative integers")
    begin, end = offsets
    elements = 1
    for dim in shape:
        elements *= dim
    if end - begin != elements * WEIGHT_DTYPES[dtype]:
        raise bad(
            f"({dtype}, shape {shape}) needs {elements * WEIGHT_DTYPES[dtype]} bytes, but its data_offsets "
            f"[{begin}, {end}] span {end - begin}"
        )
    return TensorEntry(file, dtype, tuple(shape), begin, end)


def _check_layout(file: str, entries: dict[str, TensorEntry], data_bytes: int) -> None:
    """Back to back from 0 to the end of the file, as safetensors writes (and requires)."""
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise ModelLoadError(
                f"{file}: tensor {name!r} starts at byte {entry.begin} of the data; the tensor before it ends at "
                f"{position}: the tensors would overlap or leave a gap"
            )
        position = entry.end
    if position != data_bytes:
        raise ModelLoadError(
            f"{file}: the tensors' data ends at byte {position}, but the file holds {data_bytes} bytes of data; "
            f"it is truncated or corrupt"
        )


def check_entries(spec: ModelSpec, entries: dict[str, TensorEntry]) -> None:
    """Every tensor's shape against the spec (unknown names are refused when the weights are fused)."""
    for name, entry in entries.items():
        check_shape(spec, name, entry.shape, entry.file)


def read_tensors(entries: dict[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """The tensors (views of each file's map), each checked finite."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({e.file for e in entries.values()}):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle has keys() but no __iter__
                    tensors[name] = f.get_tensor(name)
        except Exception as exc:  # safetensors' own checks (SafetensorError), an I/O error
            raise ModelLoadError(f"{file}: safetensors cannot read it ({type(exc).__name__}: {exc})") from None
    for name, tensor in tensors.items():
        check_finite(tensor, name, entries[name].file)
    return tensors


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else f"{text[:80]}..."
