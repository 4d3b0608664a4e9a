"""Llama / Mistral / Qwen2 / Qwen3 decoder over a flattened ragged batch with a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.attention import AttentionBatch, paged_attention
from conveyor.model.layers import RotaryEmbedding, apply_rotary, rms_norm, silu_and_mul
from conveyor.model.spec import ModelSpec


class LlamaModel:
    """Weights (fused QKV and gate/up) plus the forward pass; holds no per-request state."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int,
                 device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.w = {name: t.to(device) for name, t in weights.items()}
        self.dtype = self.w["embed"].dtype
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_positions, device)
        self.scale = spec.head_dim ** -0.5
        lm_head = self.w.get("lm_head", self.w["embed"])  # [vocab, hidden] (tied to the embedding if absent)
        self.lm_head = lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden] (before the final norm)."""
        spec, w = self.spec, self.w
        n = input_ids.shape[0]
        cos, sin = self.rotary.tables(positions, self.dtype)  # [num_tokens, 1, head_dim] each
        h = F.embedding(input_ids, w["embed"])  # [num_tokens, hidden]
        for i, (k_cache, v_cache) in enumerate(kv_caches):
            p = f"layers.{i}."
            x = rms_norm(h, w[p + "input_norm"], spec.rms_norm_eps)
            qkv = F.linear(x, w[p + "qkv"], w.get(p + "qkv_bias"))  # [num_tokens, q_size + 2 * kv_size]
            q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
            q = q.view(n, spec.num_heads, spec.head_dim)  # [num_tokens, heads, head_dim]
            k = k.view(n, spec.num_kv_heads, spec.head_dim)  # [num_tokens, kv_heads, head_dim]
            v = v.view(n, spec.num_kv_heads, spec.head_dim)  # [num_tokens, kv_heads, head_dim]
            if spec.qk_norm:
                q = rms_norm(q, w[p + "q_norm"], spec.rms_norm_eps)
                k = rms_norm(k, w[p + "k_norm"], spec.rms_norm_eps)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            attn = paged_attention(q, k, v, k_cache, v_cache, batch, self.scale)  # [num_tokens, heads * head_dim]
            h = h + F.linear(attn, w[p + "o_proj"])
            x = rms_norm(h, w[p + "post_norm"], spec.rms_norm_eps)
            h = h + F.linear(silu_and_mul(F.linear(x, w[p + "gate_up"])), w[p + "down"])
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, hidden] (only the rows that sample) -> [rows, vocab] float32 logits."""
        x = rms_norm(hidden, self.w["final_norm"], self.spec.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
