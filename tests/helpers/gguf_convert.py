"""llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py`), taken from the llama-cpp-python sdist on PyPI
and cached outside the repository, to write the GGUF files users bring."""

from __future__ import annotations

import functools
import io
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from typing import Any

import numpy as np

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CACHE = os.path.join(
    os.environ.get("CONVEYOR_TEST_CACHE", os.path.expanduser("~/.cache/conveyor-tests")), "llama-cpp-python-0.3.36"
)
_VENDOR = "vendor/llama.cpp/"
_NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


class ConverterUnavailable(Exception):
    """The sdist could not be downloaded or unpacked here (offline, no pip)."""


def converter_dir() -> str:
    """The folder holding convert_hf_to_gguf.py (with its `conversion` package and `gguf-py`); downloaded and
    unpacked once into CACHE."""
    script = os.path.join(CACHE, "convert_hf_to_gguf.py")
    if os.path.isfile(script):
        return CACHE
    with tempfile.TemporaryDirectory() as download:
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-binary",
                    ":all:",
                    "--no-deps",
                    LLAMA_CPP_PYTHON,
                    "-d",
                    download,
                ],
                check=True,
                capture_output=True,
                timeout=600,
            )
        except (subprocess.SubprocessError, OSError) as exc:
            stderr = getattr(exc, "stderr", b"") or b""
            raise ConverterUnavailable(
                f"pip download {LLAMA_CPP_PYTHON} failed: {exc} {stderr.decode(errors='replace')[-500:]}"
            ) from None
        archives = [f for f in os.listdir(download) if f.endswith(".tar.gz")]
        if not archives:
            raise ConverterUnavailable(f"pip download {LLAMA_CPP_PYTHON} produced no sdist: {os.listdir(download)}")
        staging = f"{CACHE}.tmp{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(os.path.join(download, archives[0])) as tar:
            for member in tar.getmembers():
                _, _, rel = member.name.partition("/")
                if not rel.startswith(_VENDOR) or not member.isfile():
                    continue
                inner = rel[len(_VENDOR) :]
                if not inner.startswith(_NEEDED):
                    continue
                target = os.path.join(staging, inner)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                with open(target, "wb") as out:
                    shutil.copyfileobj(source, out)
        if not os.path.isfile(os.path.join(staging, "convert_hf_to_gguf.py")):
            raise ConverterUnavailable(f"{archives[0]} has no {_VENDOR}convert_hf_to_gguf.py")
        os.makedirs(os.path.dirname(CACHE), exist_ok=True)
        shutil.rmtree(CACHE, ignore_errors=True)
        os.replace(staging, CACHE)
    return CACHE


@functools.cache
def tiny_sentencepiece_model(vocab_size: int) -> bytes:
    """A sentencepiece BPE tokenizer (byte fallback) of `vocab_size` pieces trained on random words: the
    converter needs a tokenizer, the tiny test models have none. Trained once per size (its words are seeded)."""
    import sentencepiece

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(300)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return model.getvalue()


def convert(folder: str, outfile: str, outtype: str = "f32") -> str:
    """HF checkpoint folder (config.json + safetensors) -> GGUF file written by llama.cpp's converter."""
    (path,) = convert_many([(folder, outfile, outtype)])
    return path


def convert_many(jobs: list[tuple[str, str, str]]) -> list[str]:
    """Several (HF folder, GGUF file, weight type) conversions by llama.cpp's converter in one interpreter
    (tests/helpers/run_converter.py: each run is the script's own `main` with its command line), so the files
    cost one torch import between them; returns the files written, in order."""
    import json

    with tempfile.TemporaryDirectory() as staging_root:
        runs = []
        for i, (folder, outfile, outtype) in enumerate(jobs):
            with open(os.path.join(folder, "config.json")) as f:
                vocab_size = int(json.load(f)["vocab_size"])
            staged = os.path.join(staging_root, str(i), os.path.basename(os.path.normpath(folder)))
            os.makedirs(staged)  # named as the source folder: the converter takes the model's name from it
            for name in os.listdir(folder):
                shutil.copy(os.path.join(folder, name), staged)
            with open(os.path.join(staged, "tokenizer.model"), "wb") as f:
                f.write(tiny_sentencepiece_model(vocab_size))
            runs.append([staged, "--outfile", outfile, "--outtype", outtype])
        script = os.path.join(converter_dir(), "convert_hf_to_gguf.py")
        runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_converter.py")
        done = subprocess.run(
            [sys.executable, runner, script],
            input=json.dumps(runs),
            capture_output=True,
            text=True,
            timeout=600,
        )
        results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if len(results) != len(jobs):
            raise RuntimeError(
                f"the converter's runner stopped after {len(results)} of {len(jobs)}:\n{done.stderr[-3000:]}"
            )
        for (folder, outfile, _), result in zip(jobs, results):
            if result["rc"] != 0 or not os.path.isfile(outfile):
                raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder}:\n{result['log']}")
    return [outfile for _, outfile, _ in jobs]


def rewrite(
    source: str,
    target: str,
    metadata: dict[str, Any] | None = None,
    tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
) -> str:
    """A copy of a GGUF file with metadata keys set ({key: (value, GGUFValueType)}) and tensors added or
    replaced ({name: (raw array, GGMLQuantizationType)}, raw bytes [rows, bytes per row] for quantized types):
    files with something Conveyor must refuse."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    metadata = dict(metadata or {})
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF.") or field.name in metadata:
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, (value, kind) in metadata.items():
        writer.add_key_value(key, value, kind)
    replaced = dict(tensors or {})
    arrays = [(t.name, t.data, t.tensor_type) for t in reader.tensors if t.name not in replaced]
    arrays += [(name, np.ascontiguousarray(array), kind) for name, (array, kind) in replaced.items()]
    for name, array, kind in arrays:
        writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, array, _ in arrays:
        writer.write_tensor_data(array)
    writer.close()
    return target


def quantization_roundtrip_reference(model: Any, gguf_path: str) -> Any:
    """transformers' model with every weight that the GGUF file stores quantized replaced by the same values
    quantized and dequantized by the `gguf` package (names mapped by gguf's own tensor-name table), so it
    computes what the file holds."""
    import copy

    import gguf
    import torch

    reader, _, names = _reader_and_name_map(gguf_path, model)
    types = {t.name: t.tensor_type for t in reader.tensors}
    quantized = copy.deepcopy(model)
    with torch.no_grad():
        for hf_name, param in quantized.named_parameters():
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            kind = types.get(gguf_name or "")
            if kind is None or kind.name == "F32":
                continue
            values = param.detach().float().numpy()
            roundtrip = gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind)
            param.copy_(torch.from_numpy(roundtrip.reshape(values.shape)))
    return quantized


def _reader_and_name_map(gguf_path: str, model: Any) -> tuple[Any, str, Any]:
    """The file's reader, its architecture name, and gguf's HF -> GGUF tensor-name table for `model`'s depth."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch_name = reader.fields["general.architecture"].contents()
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    return reader, arch_name, gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)


def llama_cpp_quantize(source: str, target: str, ftype: str = "Q4_K_M") -> str:
    """A GGUF file re-quantized by llama.cpp itself (llama-cpp-python's llama_model_quantize), as users make
    Q4_K_M files; raises ImportError where llama-cpp-python is not installed."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {ftype}) failed with status {status}")
    return target


def dequantized_reference(model: Any, gguf_path: str) -> Any:
    """transformers' model with every weight replaced by the values the GGUF file holds, dequantized by the `gguf`
    package (names mapped by gguf's own tensor-name table; for architectures whose Q/K rows the converter does not
    permute), so it computes what the file holds."""
    import copy

    import gguf
    import torch

    reader, arch_name, names = _reader_and_name_map(gguf_path, model)
    tensors = {t.name: t for t in reader.tensors}
    assert arch_name not in ("llama",), "llama-arch files permute Q/K rows; map them back before comparing"
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for hf_name, param in reference.named_parameters():
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            tensor = tensors.get(gguf_name or "")
            assert tensor is not None, f"{hf_name} has no tensor in {gguf_path}"
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            param.copy_(torch.from_numpy(values.reshape(param.shape)))
    return reference
