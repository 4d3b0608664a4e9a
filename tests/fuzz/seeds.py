"""Seed models for the fuzzer: tiny GGUF files written with the gguf package's GGUFWriter (as llama.cpp's converter
writes them) in several families and weight types, each with a small byte-level BPE tokenizer transformers can
build, and tiny Hugging Face folders (config.json + model.safetensors), all from seeded random weights, in
milliseconds and without torch (the fuzzer forks after import, so the parent runs no torch op)."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = (
    "the cat sat on the mat and the dog ate the bone while the bird sang in the tree near the house "
    "then the rain came down on the town and the people went in to eat their dinner at the table"
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_vocab(merges: int = 40) -> tuple[list[str], list[str]]:
    """GPT-2 style tokens (specials, the 256-character byte alphabet, merged pieces) and merges learned on CORPUS."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    alphabet = [spell[b] for b in range(256)]
    words = [[spell[b] for b in (" " + w if i else w).encode()] for i, w in enumerate(CORPUS.split())]
    learned: list[str] = []
    pieces: list[str] = []
    for _ in range(merges):
        pairs = Counter((w[i], w[i + 1]) for w in words for i in range(len(w) - 1))
        if not pairs:
            break
        (a, b), _count = pairs.most_common(1)[0]
        learned.append(f"{a} {b}")
        pieces.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i : i + 2] = [a + b]
                i += 1
    return SPECIALS + alphabet + pieces, learned


FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2),
    "qwen2": dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, bias=True),
    "phi3": dict(hidden=64, heads=4, kv_heads=4, ffn=128, layers=2, fused=True),
    "gemma2": dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, head_dim=16, sandwich=True, tied=True),
    "gemma3": dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, head_dim=16, sandwich=True, tied=True),
}
TINY_GGUF = (
    ("llama", "F32"),
    ("llama", "Q8_0"),
    ("llama", "Q4_1"),
    ("qwen2", "F16"),
    ("phi3", "Q5_0"),
    ("gemma2", "BF16"),
    ("gemma3", "Q4_0"),
    ("llama-256", "Q4_K"),
)
"""(family, matrix type) of the tiny GGUF seeds; llama-256 is a Llama 256 wide, as K-quant rows need."""


def write_tiny_gguf(path: str, family: str, weight_type: str, seed: int = 0) -> str:
    import gguf

    arch = family.split("-")[0]
    shape = dict(FAMILIES[arch])
    if family.endswith("-256"):
        shape.update(hidden=256, ffn=512)
    rng = np.random.default_rng(seed)
    tokens, merges = byte_level_vocab()
    vocab, h, layers = len(tokens), shape["hidden"], shape["layers"]
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    head_dim = shape.get("head_dim", h // heads)
    q, kv, ffn = heads * head_dim, kv_heads * head_dim, shape["ffn"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {family} {weight_type}")
    writer.add_context_length(256)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
        writer.add_sliding_window(16)
    if arch == "gemma3":
        writer.add_sliding_window(16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def matrix(name: str, rows: int, cols: int) -> None:
        values = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        _add(writer, name, values, weight_type, rng)

    def vector(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", vocab, h)
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", h)
        if shape.get("fused"):
            matrix(p + "attn_qkv.weight", q + 2 * kv, h)
        else:
            matrix(p + "attn_q.weight", q, h)
            matrix(p + "attn_k.weight", kv, h)
            matrix(p + "attn_v.weight", kv, h)
        if shape.get("bias"):
            for name, size in (("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)):
                vector(p + name, size)
        if arch == "gemma3":
            vector(p + "attn_q_norm.weight", head_dim)
            vector(p + "attn_k_norm.weight", head_dim)
        matrix(p + "attn_output.weight", h, q)
        if shape.get("sandwich"):
            vector(p + "post_attention_norm.weight", h)
            vector(p + "post_ffw_norm.weight", h)
        vector(p + "ffn_norm.weight", h)
        if shape.get("fused"):
            matrix(p + "ffn_up.weight", 2 * ffn, h)
        else:
            matrix(p + "ffn_gate.weight", ffn, h)
            matrix(p + "ffn_up.weight", ffn, h)
        matrix(p + "ffn_down.weight", h, ffn)
    vector("output_norm.weight", h)
    if not shape.get("tied"):
        matrix("output.weight", vocab, h)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: Any, name: str, values: np.ndarray, weight_type: str, rng: np.random.Generator) -> None:
    import gguf

    kind = gguf.GGMLQuantizationType[weight_type]
    if weight_type == "F32":
        writer.add_tensor(name, values)
    elif weight_type == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    elif weight_type in ("Q4_K", "Q6_K"):  # the gguf package has no K-quantizer: random blocks, sane scales
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (values.shape[0], values.shape[1] // block, size), dtype=np.uint8)
        scale = np.full((values.shape[0], values.shape[1] // block), 0.01, dtype=np.float16).view(np.uint8)
        at = 0 if weight_type == "Q4_K" else 208
        raw[..., at : at + 2] = scale.reshape(*scale.shape[:-1], -1, 2)
        if weight_type == "Q4_K":
            raw[..., 2:4] = scale.reshape(*scale.shape[:-1], -1, 2)
        raw = raw.reshape(values.shape[0], -1)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    else:
        blocks = gguf.quants.quantize(values, kind)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)


def write_tiny_folder(folder: str, arch: str = "llama", dtype: str = "F32", seed: int = 0) -> str:
    """A Hugging Face folder: config.json and model.safetensors (no tokenizer files: token-id prompts only)."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, heads, kv_heads, ffn, layers, vocab = 64, 4, 2, 128, 2, 300
    head_dim = h // heads
    config = {
        "architectures": {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"]}[arch],
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
    }
    np_dtype = {"F32": np.float32, "F16": np.float16}[dtype]
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, h)) * 0.2,
        "model.norm.weight": 1.0 + 0.1 * rng.standard_normal(h),
        "lm_head.weight": rng.standard_normal((vocab, h)) * 0.2,
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(h)
        tensors[p + "post_attention_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(h)
        for name, rows, cols in (
            ("self_attn.q_proj.weight", heads * head_dim, h),
            ("self_attn.k_proj.weight", kv_heads * head_dim, h),
            ("self_attn.v_proj.weight", kv_heads * head_dim, h),
            ("self_attn.o_proj.weight", h, heads * head_dim),
            ("mlp.gate_proj.weight", ffn, h),
            ("mlp.up_proj.weight", ffn, h),
            ("mlp.down_proj.weight", h, ffn),
        ):
            tensors[p + name] = rng.standard_normal((rows, cols)) * 0.2
        if arch == "qwen2":
            for name, size in (
                ("q_proj", heads * head_dim),
                ("k_proj", kv_heads * head_dim),
                ("v_proj", kv_heads * head_dim),
            ):
                tensors[f"{p}self_attn.{name}.bias"] = 0.1 * rng.standard_normal(size)
    save_file({k: v.astype(np_dtype) for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return folder


TINY_FOLDERS = (("llama", "F32"), ("qwen2", "F16"))
