"""Tiny random-weight transformers checkpoints of every supported family, for tests that compare against
transformers on small shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def build_tiny_model(arch: str, folder: str, **overrides: Any) -> Any:
    """A small random-weight transformers model saved as a checkpoint folder; returns the HF model."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    configs: dict[str, Callable[..., Any]] = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "phi3": transformers.Phi3Config,
        "gemma3": transformers.Gemma3TextConfig,
    }
    if arch == "mistral":
        common["sliding_window"] = None
    if arch == "qwen3":
        common["head_dim"] = 32
    if arch == "gemma2":  # a window shorter than the test prompts, logits that reach the soft caps
        common.update(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,
            attn_logit_softcapping=2.0,
            tie_word_embeddings=True,  # Gemma ties them (llama.cpp's converter drops an lm_head)
            final_logit_softcapping=5.0,
        )
    if arch == "gemma3":  # local layers (window 16, own rope base) and a global one with linear rope scaling
        common.update(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    if arch == "phi3":
        common.update(original_max_position_embeddings=512)
    common.update(overrides)
    config = configs[arch](**common)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases away from their trivial init, so they matter in the comparison
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
        if arch in ("gemma2", "gemma3"):  # scaled by sqrt(hidden) and tied, the embedding would otherwise
            model.get_input_embeddings().weight.mul_(0.1)  # dominate: greedy would repeat the input token
    model.save_pretrained(folder)
    return model
