"""GGUF files: metadata -> ModelSpec, tensors dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of Llama's Q and K projections so that rotary
pairs are adjacent (interleaved rope). We undo that permutation, so every format ends in
Hugging Face's layout and one rotary implementation (rotate-half) serves all.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

import numpy as np
import torch

from conveyor.errors import ModelLoadError
from conveyor.model.loader import LoadedModel, fuse_weights
from conveyor.model.spec import ModelSpec, RopeSpec

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleaving of a Q or K projection [rows, cols]."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_spec(reader: Any, path: str) -> ModelSpec:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{key} is missing; the file is incomplete")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    names = {t.name for t in reader.tensors}
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} in GGUF files is not supported yet; "
                             f"use the Hugging Face checkpoint folder of this model")
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    return ModelSpec(
        architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")),
        num_heads=heads, num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim, rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope=RopeSpec(theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0))),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(sorted({int(t) for t in (eos, eot) if t is not None})),
    )


def load_gguf(path: str, dtype: torch.dtype) -> LoadedModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the gguf package raises plain ValueError/struct errors on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    spec = read_spec(reader, path)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        array = array.reshape([int(d) for d in reversed(t.shape)]) if array.ndim != len(t.shape) else array
        if spec.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = spec.num_heads if "q_proj" in name else spec.num_kv_heads
            array = unpermute_rows(array, heads)
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
    weights = fuse_weights(spec, tensors.get, dtype, path)
    return LoadedModel(spec=spec, weights=weights, tokenizer=load_gguf_tokenizer(path), source=path)


def load_gguf_tokenizer(path: str) -> Any:
    """transformers builds the tokenizer (and chat template) from GGUF metadata; that takes
    seconds, so the result is saved once under ~/.cache/conveyor and read from there."""
    from transformers import AutoTokenizer

    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache_root = os.environ.get("CONVEYOR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "conveyor"))
    cache_dir = os.path.join(cache_root, "tokenizers", key)
    if os.path.isfile(os.path.join(cache_dir, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache_dir)
        except Exception:  # a damaged cache entry: rebuild it below
            logger.warning("tokenizer cache %s is unreadable; rebuilding it from the GGUF file", cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    try:
        tmp = f"{cache_dir}.tmp{os.getpid()}"
        tokenizer.save_pretrained(tmp)
        if os.path.exists(cache_dir):
            shutil.rmtree(cache_dir, ignore_errors=True)
        os.replace(tmp, cache_dir)
    except OSError as exc:
        logger.info("could not cache the tokenizer in %s (%s); it will be rebuilt next time", cache_dir, exc)
    return tokenizer
