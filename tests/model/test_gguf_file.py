"""Our GGUF reader against the gguf package's own `GGUFReader` on a file its `GGUFWriter` wrote: every metadata
value (with its Python type) and every tensor (type, shape, bytes, offset, data) the same; bad files refused by
name."""

from __future__ import annotations

import pathlib
import struct

import gguf
import numpy as np
import pytest

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_file import read_gguf
from conveyor.model.gguf_loader import open_gguf


def _write(path: pathlib.Path, alignment: int | None = None) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo wörld ✓")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "ß", "<|end|>"] * 50)
    writer.add_array("t.ints", list(range(-5, 300)))
    writer.add_array("t.floats", [0.5, -1.25, 3.0])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.empty_array", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((5, 32)).astype(np.float16))
    writer.add_tensor("vector", rng.standard_normal(7, dtype=np.float32))
    writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_1, gguf.GGMLQuantizationType.BF16):
        blocks = gguf.quants.quantize(rng.standard_normal((4, 256), dtype=np.float32), kind)
        writer.add_tensor(kind.name.lower(), blocks, raw_shape=blocks.shape, raw_dtype=kind)
    q4_k = rng.integers(0, 256, (3, 2 * 144), dtype=np.uint8)  # two 256-value blocks per row (gguf cannot make them)
    writer.add_tensor("q4_k", q4_k, raw_shape=q4_k.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("alignment", [None, 64])
def test_reader_matches_the_gguf_package(tmp_path: pathlib.Path, alignment: int | None) -> None:
    path = _write(tmp_path / "all.gguf", alignment)
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        expected = field.contents()
        assert ours.fields[key] == expected and type(ours.fields[key]) is type(expected), key
        if isinstance(expected, list) and expected:
            assert type(ours.fields[key][0]) is type(expected[0]), key
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors) == 8
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.shape, mine.n_bytes, mine.data_offset) == (
            reference.name,
            reference.tensor_type,
            tuple(int(d) for d in reference.shape),
            int(reference.n_bytes),
            int(reference.data_offset),
        )
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


def test_bad_files_are_refused_by_name(tmp_path: pathlib.Path) -> None:
    good = pathlib.Path(_write(tmp_path / "good.gguf")).read_bytes()
    cases = {
        "not-gguf": (b"PK\x03\x04" + good[4:], "not b'GGUF'"),
        "version": (good[:4] + struct.pack("<I", 7) + good[8:], "GGUF version 7 is not supported"),
        "big-endian": (good[:4] + struct.pack(">I", 3) + good[8:], "big-endian"),
        "header-cut": (good[:200], "truncated"),
        "data-cut": (good[:-100], "runs past the end of the file"),
        "empty": (b"", "truncated"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(ModelLoadError, match=message):
            open_gguf(str(path))
    with pytest.raises(ModelLoadError, match="cannot be read"):
        open_gguf(str(tmp_path / "missing.gguf"))
