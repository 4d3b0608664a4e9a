"""Write a random-weight Llama checkpoint (HF folder: config.json, bfloat16 model.safetensors, tokenizer) for
benchmarks at the size people run on CPUs. Nothing is downloaded: the tokenizer is the embedded default model's
(SmolLM2, 49152 tokens, whose pre-tokenizer llama.cpp's converter knows), so the folder also converts to GGUF.

    .venv/bin/python scripts/make_random_checkpoint.py OUT_DIR [--shape llama-3.2-1b]

`llama-3.2-1b` is Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, rope theta
500000 with llama3 scaling, tied embeddings) with the default model's 49152-token vocabulary: 1.07 B parameters,
2.1 GB in bfloat16. Weights are normal(0, 0.02) from a fixed seed, so two runs write the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHAPES: dict[str, dict[str, object]] = {
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
    },
    "llama-tiny": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from conveyor.model.gguf_loader import load_gguf_tokenizer
    from conveyor.model.loader import default_model_path

    tokenizer = load_gguf_tokenizer(default_model_path())
    config = LlamaConfig(
        vocab_size=49152,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
        **SHAPES[args.shape],
    )
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    generator = torch.Generator().manual_seed(args.seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": normal(config.vocab_size, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for i in range(layers):
        prefix = f"model.layers.{i}"
        tensors.update(
            {
                f"{prefix}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                f"{prefix}.self_attn.q_proj.weight": normal(q_out, hidden),
                f"{prefix}.self_attn.k_proj.weight": normal(kv_out, hidden),
                f"{prefix}.self_attn.v_proj.weight": normal(kv_out, hidden),
                f"{prefix}.self_attn.o_proj.weight": normal(hidden, q_out),
                f"{prefix}.mlp.gate_proj.weight": normal(inter, hidden),
                f"{prefix}.mlp.up_proj.weight": normal(inter, hidden),
                f"{prefix}.mlp.down_proj.weight": normal(hidden, inter),
            }
        )
    os.makedirs(args.out_dir, exist_ok=True)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(args.out_dir)
    save_file(tensors, os.path.join(args.out_dir, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(args.out_dir)
    with open(os.path.join(args.out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "do_sample": False}, f)
    params = sum(t.numel() for t in tensors.values())
    print(f"wrote {args.out_dir}: {args.shape}, {params / 1e9:.2f} B parameters, {params * 2 / 1e9:.2f} GB bfloat16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
