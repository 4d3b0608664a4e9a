"""Llama / Mistral / Qwen2 / Qwen3 decoder over a flattened ragged batch with a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.attention import AttentionBatch, paged_attention
from conveyor.model.native import NativeKernels
from conveyor.model.layers import RotaryEmbedding, apply_rotary, rms_norm, silu_and_mul
from conveyor.model.quant import make_lm_head, make_projection
from conveyor.model.spec import ModelSpec


class LlamaModel:
    """Weights (fused QKV and gate/up) plus the forward pass; holds no per-request state."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int,
                 device: torch.device, quantization: str | None = None,
                 kernels: NativeKernels | None = None) -> None:
        self.spec = spec
        self.device = device
        w = {name: t.to(device) for name, t in weights.items()}
        self.dtype = w["embed"].dtype
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_positions, device)
        self.scale = spec.head_dim ** -0.5
        self.kernels = kernels
        """Native CPU kernels (model/native.py), or None for torch's ops."""
        self.embed = w["embed"]  # [vocab, hidden]
        self.final_norm = w["final_norm"]
        self.lm_head = make_lm_head(w.get("lm_head", w["embed"]), quantization,
                                    kernels)  # tied to the embedding when absent
        self.layers = [_Layer(w, f"layers.{i}.", quantization, kernels) for i in range(spec.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden] (before the final norm)."""
        spec = self.spec
        n = input_ids.shape[0]
        cos, sin = self.rotary.tables(positions, self.dtype)  # [num_tokens, 1, head_dim] each
        h = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        delta: torch.Tensor | None = None  # the previous layer's MLP output, not yet added to h
        decode_op = self.kernels.decode_attention if self.kernels is not None else None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h, x = self._add_norm(h, delta, layer.input_norm)  # h += delta; x = norm(h)
            qkv = layer.qkv(x)  # [num_tokens, q_size + 2 * kv_size]
            kv_written = False
            v = qkv[:, spec.q_size + spec.kv_size:].view(n, spec.num_kv_heads, spec.head_dim)  # [tokens, kv_heads, d]
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k, _ = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
                q = rms_norm(q.view(n, spec.num_heads, spec.head_dim), layer.q_norm, spec.rms_norm_eps)
                k = rms_norm(k.view(n, spec.num_kv_heads, spec.head_dim), layer.k_norm, spec.rms_norm_eps)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            elif self.kernels is not None:  # rotary and the cache write in one native pass
                qk = self.kernels.rotary_and_cache(qkv, cos.view(n, -1), sin.view(n, -1), k_cache, v_cache,
                                                   batch.slot_mapping, spec.num_heads, spec.num_kv_heads)
                q, k = qk[:, :spec.num_heads], qk[:, spec.num_heads:]  # [tokens, heads | kv_heads, head_dim]
                kv_written = True
            else:  # Q and K heads side by side in qkv: rotated in one pass
                qk = qkv[:, :spec.q_size + spec.kv_size].view(n, spec.num_heads + spec.num_kv_heads, spec.head_dim)
                qk = apply_rotary(qk, cos, sin)  # [num_tokens, heads + kv_heads, head_dim]
                q, k = qk[:, :spec.num_heads], qk[:, spec.num_heads:]
            attn = paged_attention(q, k, v, k_cache, v_cache, batch, self.scale, decode_op,
                                   kv_written)  # [num_tokens, heads * head_dim]
            h, x = self._add_norm(h, layer.o_proj(attn), layer.post_norm)
            gate_up = layer.gate_up(x)  # [num_tokens, 2 * intermediate]
            act = self.kernels.silu_and_mul(gate_up) if self.kernels is not None else silu_and_mul(gate_up)
            delta = layer.down(act)  # [num_tokens, hidden]
        return h if delta is None else h + delta

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (h + delta, rms_norm(h + delta) * weight); the native kernel adds into h in place."""
        if self.kernels is not None:
            return h, self.kernels.add_rms_norm(h, delta, weight, self.spec.rms_norm_eps)
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, weight, self.spec.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, hidden] (only the rows that sample) -> [rows, vocab] logits in the model's dtype
        (the sampler widens them to float32 where it processes them)."""
        _, x = self._add_norm(hidden.contiguous(), None, self.final_norm)
        return self.lm_head(x)


class _Layer:
    """One decoder layer's weights."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, quantization: str | None,
                 kernels: NativeKernels | None) -> None:
        self.input_norm = w[prefix + "input_norm"]
        self.post_norm = w[prefix + "post_norm"]
        self.qkv = make_projection(w[prefix + "qkv"], w.get(prefix + "qkv_bias"), quantization, kernels)
        self.o_proj = make_projection(w[prefix + "o_proj"], None, quantization, kernels)
        self.gate_up = make_projection(w[prefix + "gate_up"], None, quantization, kernels)
        self.down = make_projection(w[prefix + "down"], None, quantization, kernels)
        self.q_norm = w.get(prefix + "q_norm")
        self.k_norm = w.get(prefix + "k_norm")
