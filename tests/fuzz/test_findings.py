"""Each hostile-file finding (the fuzzer's, and those of the issue that asked for it) as a regression test: refused
at load, quickly, with a ModelLoadError naming the file, the key or tensor, the value and what is expected, and
`conveyor inspect` refusing it too (a NaN weight excepted: inspect reads no weight values)."""

from __future__ import annotations

import json
import math
import struct
import time
from typing import Any

import pytest
from gguf import GGUFValueType

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_loader import prepare_gguf
from conveyor.model.inspect import inspect_model
from conveyor.model.loader import load_model

from .gguf_mutator import GGUFMutator
from .safetensors_mutator import SafetensorsMutator
from .seeds import write_tiny_folder, write_tiny_gguf


@pytest.fixture(scope="module")
def default_model(default_gguf: str) -> GGUFMutator:
    with open(default_gguf, "rb") as f:
        return GGUFMutator(f.read())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: Any) -> dict[str, GGUFMutator]:
    folder = tmp_path_factory.mktemp("tiny-seeds")
    seeds = {}
    for family, weight_type in (("llama", "F32"), ("llama", "Q4_1")):
        path = write_tiny_gguf(str(folder / f"{family}-{weight_type}.gguf"), family, weight_type)
        with open(path, "rb") as f:
            seeds[weight_type] = GGUFMutator(f.read())
    return seeds


def _file(tmp_path: Any, data: bytes) -> str:
    folder = tmp_path / "case"
    folder.mkdir(exist_ok=True)
    path = folder / "model.gguf"
    path.write_bytes(data)
    return str(path)


def _refused(path: str, *fragments: str, load: bool = False) -> str:
    """The file refused (by the header-level checks, or by a whole load), naming the file and each fragment."""
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        load_model(path, "float32") if load else prepare_gguf(path)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert path in message and all(f in message for f in fragments), message
    return message


def _entry(mutator: GGUFMutator, key: str) -> Any:
    return next(e for e in mutator.layout.entries if e.key == key)


def _info(mutator: GGUFMutator, name: str) -> Any:
    return next(t for t in mutator.layout.infos if t.name == name)


def test_a_shifted_tensor_table_is_refused_at_once(default_model: GGUFMutator, tmp_path: Any) -> None:
    """n_dims 2 -> 1 shifted the parse into a ~700 KB name and ~815 million dimensions, and the reader built an
    error string per dimension: now the name's length is bounded before it is read."""
    t = _info(default_model, "blk.0.attn_k.weight")
    path = _file(tmp_path, default_model.put(t.ndims_at, "<I", 1))
    _refused(path, "has a name of", "expected 1 to 63")
    summary = inspect_model(path)
    assert not summary.runs and "expected 1 to 63" in summary.reason


@pytest.mark.parametrize(
    "tensor, change, fragment",
    [
        ("blk.23.attn_output.weight", ("type", 0), "llama.cpp's layout puts it at"),  # F32 for Q4_1
        ("blk.9.attn_q.weight", ("offset", -32), "'blk.9.attn_q.weight' starts at offset"),
        ("blk.2.attn_q.weight", ("offset_of", "blk.1.attn_q.weight"), "'blk.2.attn_q.weight' starts at offset"),
        ("blk.4.ffn_up.weight", ("dim", 2**63), "needs more bytes than the file's data section holds"),
        ("blk.4.ffn_up.weight", ("dim", 0), "every dimension must be at least 1"),
    ],
)
def test_tensor_table_tampering_is_refused(
    default_model: GGUFMutator, tmp_path: Any, tensor: str, change: tuple[str, Any], fragment: str
) -> None:
    t = _info(default_model, tensor)
    kind, value = change
    if kind == "type":
        data = default_model.put(t.type_at, "<I", value)
    elif kind == "offset":
        data = default_model.put(t.offset_at, "<Q", t.offset + value)
    elif kind == "offset_of":
        data = default_model.put(t.offset_at, "<Q", _info(default_model, value).offset)
    else:
        data = default_model.put(t.ndims_at + 4, "<Q", value)
    _refused(_file(tmp_path, data), fragment)


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("llama.attention.layer_norm_rms_epsilon", math.nan, "layer_norm_rms_epsilon=nan (FLOAT32); expected a finite"),
        ("llama.attention.layer_norm_rms_epsilon", -math.inf, "layer_norm_rms_epsilon=-inf"),
        ("llama.rope.freq_base", 0.0, "llama.rope.freq_base=0.0 (FLOAT32); expected a finite float above 0"),
        ("llama.context_length", 2**31, "llama.context_length=2147483648 (UINT32); expected an integer from 1 to"),
        ("llama.attention.head_count_kv", 0, "head_count_kv=0"),
        ("tokenizer.ggml.eos_token_id", 49152, "eos_token_id=49152 is outside the vocabulary of 49152 tokens"),
    ],
)
def test_metadata_out_of_range_is_refused(
    default_model: GGUFMutator, tmp_path: Any, key: str, value: float, fragment: str
) -> None:
    e = _entry(default_model, key)
    code = "<f" if isinstance(value, float) else "<I"
    _refused(_file(tmp_path, default_model.put(e.value_at, code, value)), fragment)


def test_a_changed_alignment_is_refused(default_model: GGUFMutator, tmp_path: Any) -> None:
    key = b"general.alignment"
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<II", GGUFValueType.UINT32, 1)
    at = default_model.layout.entries[0].start
    data = default_model.splice(at, at, entry, kv_delta=1)  # the data section stays where alignment 32 put it
    _refused(_file(tmp_path, data), "after its last tensor's data")


def test_header_counts_are_bounded_by_the_file(default_model: GGUFMutator, tmp_path: Any) -> None:
    _refused(_file(tmp_path, default_model.put(8, "<Q", 2**63)), "the header claims 9223372036854775808 tensors")
    e = _entry(default_model, "tokenizer.ggml.merges")
    data = default_model.put(e.count_at, "<Q", 815_000_000)
    _refused(_file(tmp_path, data), "'tokenizer.ggml.merges' claims 815000000 STRING values")


def test_nonfinite_weights_are_refused_at_load(tiny: dict[str, GGUFMutator], tmp_path: Any) -> None:
    f32 = tiny["F32"]
    norm = _info(f32, "blk.1.ffn_norm.weight")
    path = _file(tmp_path, f32.put(f32.layout.data_start + norm.offset + 8, "<f", math.nan))
    _refused(path, "'blk.1.ffn_norm.weight' holds 1 NaN or infinite value(s)", load=True)
    assert inspect_model(path).runs  # inspect reads no weight values (documented)
    q41 = tiny["Q4_1"]
    matrix = _info(q41, "blk.0.ffn_down.weight")
    path = _file(tmp_path, q41.put(q41.layout.data_start + matrix.offset + 20 * 3 + 2, "<e", math.inf))
    _refused(path, "'blk.0.ffn_down.weight' holds 1 NaN or infinite block scale(s)", load=True)


def test_shapes_are_checked_at_load_for_quantized_tensors(tiny: dict[str, GGUFMutator], tmp_path: Any) -> None:
    q41 = tiny["Q4_1"]
    t = _info(q41, "blk.0.ffn_gate.weight")  # [64 cols, 128 rows] -> [128, 64]: the same bytes, the wrong shape
    data = q41.splice(t.ndims_at + 4, t.type_at, struct.pack("<2Q", 128, 64))
    _refused(_file(tmp_path, data), "'blk.0.ffn_gate.weight' has shape [128, 64] (GGUF order); the model's metadata")


def test_tokenizer_metadata_is_checked_before_transformers_sees_it(tiny: dict[str, GGUFMutator], tmp_path: Any) -> None:
    f32 = tiny["F32"]
    bos = _entry(f32, "tokenizer.ggml.bos_token_id")
    _refused(_file(tmp_path, f32.put(bos.value_at, "<I", 299)), "bos_token_id=299 is outside the vocabulary")
    types = _entry(f32, "tokenizer.ggml.token_type")
    data = f32.splice(types.count_at, types.end, struct.pack("<Q", 298) + f32.data[types.count_at + 8 : types.end - 4])
    _refused(_file(tmp_path, data), "token_type has 298 entries; expected one per token (299")
    merges = _entry(f32, "tokenizer.ggml.merges")
    (length,) = struct.unpack_from("<Q", f32.data, merges.count_at + 8)
    bad = b"a b c"
    first = merges.count_at + 8
    data = f32.splice(first, first + 8 + length, struct.pack("<Q", len(bad)) + bad)
    _refused(_file(tmp_path, data), "transformers cannot build a tokenizer", load=True)


def test_a_damaged_key_is_refused(tiny: dict[str, GGUFMutator], tmp_path: Any) -> None:
    f32 = tiny["F32"]
    e = _entry(f32, "tokenizer.ggml.eos_token_id")
    data = bytearray(f32.data)
    data[e.key_at + len("tokenizer.ggml.e")] = ord("x")  # tokenizer.ggml.exs_token_id: an unknown tokenizer key
    _refused(_file(tmp_path, bytes(data)), "'tokenizer.ggml.exs_token_id' is not a tokenizer key llama.cpp defines")


@pytest.fixture(scope="module")
def folder_mutator(tmp_path_factory: Any) -> SafetensorsMutator:
    folder = write_tiny_folder(str(tmp_path_factory.mktemp("hf-seed")), "llama", "F32")
    with open(f"{folder}/config.json", "rb") as c, open(f"{folder}/model.safetensors", "rb") as w:
        return SafetensorsMutator(c.read(), w.read())


def _folder(tmp_path: Any, files: dict[str, bytes]) -> str:
    folder = tmp_path / "case"
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return str(folder)


def _config(mutator: SafetensorsMutator, **changes: Any) -> dict[str, bytes]:
    config = json.loads(mutator.config_bytes)
    config.update(changes)
    return mutator.folder(config=json.dumps(config).encode())


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda m: m.folder(config=b'{"architectures": ["LlamaForCausalLM"], '), "config.json: not valid JSON"),
        (lambda m: _config(m, rms_norm_eps=math.nan), "config.json: rms_norm_eps=nan; expected a finite number"),
        (lambda m: _config(m, hidden_size="64"), "config.json: hidden_size='64'; expected an integer from 1 to"),
        (lambda m: _config(m, tie_word_embeddings="false"), "tie_word_embeddings='false'; expected true or false"),
        (lambda m: _config(m, rope_theta=-1.0), "rope_theta=-1.0; expected a finite number above 0"),
        (lambda m: _config(m, num_key_value_heads=3), "the model's num_kv_heads is 3; expected a divisor of the 4"),
        (lambda m: m.folder(struct.pack("<Q", 2**63) + m.weights[8:]), "the header claims 9223372036854775808 bytes"),
        (lambda m: m.with_header("[" * 100_000 + "]" * 100_000), "the safetensors header is not valid JSON"),
        (lambda m: _header(m, "model.norm.weight", dtype="I32"), "'model.norm.weight' has dtype 'I32'; Conveyor"),
        (lambda m: _header(m, "model.norm.weight", data_offsets=[0, 256]), "would overlap or leave a gap"),
        (lambda m: _header(m, "lm_head.weight", shape=[64, 300]), "'lm_head.weight' has shape [64, 300]; the model"),
        (lambda m: m.folder(m.weights[:-10]), "the tensors' data ends at byte"),
    ],
)
def test_hostile_folders_are_refused_by_name(
    folder_mutator: SafetensorsMutator, tmp_path: Any, make: Any, fragment: str
) -> None:
    path = _folder(tmp_path, make(folder_mutator))
    with pytest.raises(ModelLoadError) as info:
        load_model(path, "float32")
    assert path in str(info.value) and fragment in str(info.value), str(info.value)
    summary = inspect_model(path)
    assert not summary.runs and fragment in summary.reason, summary.reason


def _header(mutator: SafetensorsMutator, name: str, **changes: Any) -> dict[str, bytes]:
    header = mutator.copy()
    header[name].update(changes)
    return mutator.with_header(header)


def test_a_name_twice_in_a_safetensors_header_is_refused(folder_mutator: SafetensorsMutator, tmp_path: Any) -> None:
    text = json.dumps(folder_mutator.header, separators=(",", ":"))
    entry = json.dumps({"model.norm.weight": folder_mutator.header["model.norm.weight"]}, separators=(",", ":"))
    path = _folder(tmp_path, folder_mutator.with_header(text[:-1] + "," + entry[1:-1] + "}"))
    with pytest.raises(ModelLoadError, match="the name 'model.norm.weight' appears twice"):
        load_model(path, "float32")


def test_a_nonfinite_safetensors_weight_is_refused(folder_mutator: SafetensorsMutator, tmp_path: Any) -> None:
    begin, _ = folder_mutator.header["model.layers.1.mlp.down_proj.weight"]["data_offsets"]
    body = bytearray(folder_mutator.body)
    body[begin + 40 : begin + 44] = struct.pack("<f", math.nan)
    path = _folder(tmp_path, folder_mutator.with_header(folder_mutator.header, bytes(body)))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.down_proj.weight' holds 1 NaN or infinite value"):
        load_model(path, "float32")


def test_a_context_too_long_for_memory_is_refused_before_any_table(monkeypatch: Any) -> None:
    """llama.context_length = 2**24 would make the rotary tables and one request's KV cache outgrow memory: the
    engine's max_model_len is refused before anything of that size is allocated."""
    import dataclasses

    from conveyor.model import loader
    from conveyor.model.model_spec import ModelSpec, RopeSpec

    spec = ModelSpec("llama", 300, 64, 128, 2, 4, 2, 16, 1e-5, RopeSpec(theta=1e4), 2**24, False)
    monkeypatch.setattr(loader, "available_memory", lambda info: 2 * 2**30)  # it needs 4 GiB
    with pytest.raises(ModelLoadError, match=r"max_model_len=16777216 \(the model's context length\) would need"):
        loader.resolve_max_model_len(spec, None)
    assert loader.resolve_max_model_len(spec, 4096) == 4096
    assert loader.resolve_max_model_len(dataclasses.replace(spec, max_position_embeddings=8192), None) == 8192


def test_cli_inspect_reports_a_refusal_without_a_traceback(
    default_model: GGUFMutator, tmp_path: Any, capsys: Any
) -> None:
    from conveyor.cli import main

    e = _entry(default_model, "llama.attention.layer_norm_rms_epsilon")
    path = _file(tmp_path, default_model.put(e.value_at, "<f", math.nan))
    assert main(["inspect", path]) == 1
    out = capsys.readouterr().out
    assert "conveyor      refuses it: " in out and "layer_norm_rms_epsilon=nan" in out
