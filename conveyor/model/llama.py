"""Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / Phi-3 decoder over a flattened ragged batch with a paged KV
cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from conveyor.model.attention import AttentionBatch, paged_attention
from conveyor.model.decode_stack import DecodeStack
from conveyor.model.gguf_projection import GGUFProjection, GGUFSiluGate
from conveyor.model.gguf_quant import AnyWeight, RowStack, embedding_rows, place_weights, plain_tensor
from conveyor.model.layers import Projection, SiluGateProjection, apply_rotary, gelu_tanh_and_mul, rms_norm
from conveyor.model.model_spec import ModelSpec
from conveyor.model.native import NativeKernels
from conveyor.model.ops import layer_ops
from conveyor.model.quant import Int4Projection, make_lm_head, make_projection
from conveyor.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from conveyor.tensor_parallel.group import TensorParallelGroup


class LlamaModel:
    """Weights (fused QKV and gate/up) plus the forward pass; holds no per-request state."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: Mapping[str, AnyWeight],
        max_positions: int,
        device: torch.device,
        quantization: str | None = None,
        kernels: NativeKernels | None = None,
        gguf_weights: str = "auto",
    ) -> None:
        self.spec = spec
        self.device = device
        w = place_weights(weights, device, kernels, gguf_weights)  # GGUF blocks compact or dequantized
        self.kernels = kernels
        self.dtype = w["embed"].dtype
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_positions, device)
        self.local_rotary = (
            RotaryEmbedding(spec.local_rope, spec.head_dim, max_positions, device)
            if spec.local_rope is not None
            else None
        )
        """Gemma 3: the sliding-window layers' own rotary embedding."""
        self.scale = spec.attention_scale if spec.attention_scale is not None else spec.head_dim**-0.5
        self.embed_multiplier = (
            torch.tensor(spec.embedding_multiplier, dtype=self.dtype).item()
            if spec.embedding_multiplier != 1.0
            else None
        )
        """Gemma: sqrt(hidden), rounded to the compute dtype first as transformers does."""
        self.ops = layer_ops(kernels)
        """The small per-layer ops: native CPU kernels (model/native.py) when given, else torch's."""
        embed = w["embed"]  # [vocab, hidden]
        if isinstance(embed, RowStack):  # one tensor in the file: a tensor, or one type's GGUF blocks
            raise TypeError("weight 'embed' is a RowStack; the embedding must be one tensor or one QuantizedWeight")
        self.embed = embed
        self.final_norm = plain_tensor(w["final_norm"], "final_norm")
        self.lm_head = make_lm_head(
            w.get("lm_head", w["embed"]), quantization, kernels
        )  # tied to the embedding when absent
        self.layers = [
            _Layer(w, f"layers.{i}.", quantization, kernels, spec.activation) for i in range(spec.num_layers)
        ]
        self.windows = [spec.window_of(i) for i in range(spec.num_layers)]
        """Per layer: its sliding window, or None for full attention."""
        self.parallel: TensorParallelGroup | None = None
        """Under tensor parallelism (conveyor/tensor_parallel): this rank's group; the weights are then its shards."""
        self.decode_stack = DecodeStack(self, kernels) if kernels is not None and DecodeStack.applies(self) else None
        """Pure-decode steps' layers in one native call, where every layer is the plain Llama kind on AMX."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden] (before the final norm)."""
        spec, ops, eps = self.spec, self.ops, self.spec.rms_norm_eps
        n = input_ids.shape[0]
        parallel = self.parallel
        h = (
            embedding_rows(self.embed, input_ids, self.kernels)
            if parallel is None
            else parallel.embed(
                input_ids, plain_tensor(self.embed, "embed")
            )  # a shard: dense (tensor_parallel/shard.py)
        )  # [num_tokens, hidden]
        if self.embed_multiplier is not None:
            h = h * self.embed_multiplier
        if self.decode_stack is not None and parallel is None and DecodeStack.takes(batch, n):
            return self.decode_stack(h, positions, self.rotary, batch, kv_caches)  # the loop below, in C++
        tables = self.rotary.tables(positions, self.dtype)  # cos, sin: [num_tokens, 1, head_dim] each
        local_tables = self.local_rotary.tables(positions, self.dtype) if self.local_rotary is not None else tables
        delta: torch.Tensor | None = None  # the previous layer's MLP output, not yet added to h
        for layer, window, (k_cache, v_cache) in zip(self.layers, self.windows, kv_caches):
            cos, sin = tables if window is None else local_tables
            h, x = ops.add_norm(h, delta, layer.input_norm, eps)  # h += delta; x = norm(h)
            qkv = layer.qkv(x)  # [num_tokens, q_size + 2 * kv_size]
            v = qkv[:, spec.q_size + spec.kv_size :].view(n, spec.num_kv_heads, spec.head_dim)  # [tokens, kv_heads, d]
            if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3, Gemma 3: per-head norms before rotary
                q, k, _ = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
                q = rms_norm(q.view(n, spec.num_heads, spec.head_dim), layer.q_norm, eps)
                k = rms_norm(k.view(n, spec.num_kv_heads, spec.head_dim), layer.k_norm, eps)
                q, k, kv_written = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), False
            else:
                q, k, kv_written = ops.rotate_and_write(qkv, cos, sin, k_cache, v_cache, batch.slot_mapping, spec)
            attn = paged_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                batch,
                self.scale,
                ops.decode_attention,
                kv_written,
                window,
                spec.attn_logit_softcap,
                ops.prefill_attention,
            )  # [num_tokens, heads * head_dim]
            attn = layer.o_proj(attn)  # [num_tokens, hidden]
            if parallel is not None:  # row-parallel: each rank's heads gave a partial sum
                attn = parallel.all_reduce(attn)
            if layer.attn_out_norm is not None:  # Gemma 2's sandwich norms
                attn = rms_norm(attn, layer.attn_out_norm, eps)
            h, x = ops.add_norm(h, attn, layer.post_norm, eps)
            if layer.silu_gate is not None:  # the activation applied inside the product
                act = layer.silu_gate(x)  # [num_tokens, intermediate]
            else:
                assert layer.gate_up is not None  # _mlp_input gives a layer one of the two
                gate_up = layer.gate_up(x)  # [num_tokens, 2 * intermediate]
                act = ops.silu_and_mul(gate_up) if spec.activation == "silu" else gelu_tanh_and_mul(gate_up)
            delta = layer.down(act)  # [num_tokens, hidden]
            if parallel is not None:
                delta = parallel.all_reduce(delta)
            if layer.mlp_out_norm is not None:
                delta = rms_norm(delta, layer.mlp_out_norm, eps)
        return h if delta is None else h + delta

    def greedy_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """hidden: [rows, hidden] (only the rows that sample) -> ([rows] int64, each row's argmax of logits(hidden)
        (the first largest bfloat16 logit, as the sampler's argmax takes it), [rows] bool, whether that logit is
        below +inf: the sampler's finite_rows, its value recomputed from the head's row), found by the LM head's
        product without writing the logits; None where the head is not a bfloat16 one on our AMX kernel, or is
        sharded or soft-capped (the caller then takes logits() and samples)."""
        if (
            self.parallel is not None
            or self.spec.final_logit_softcap is not None
            or not isinstance(self.lm_head, Projection)
            or not self.lm_head.computes_argmax
        ):
            return None
        _, x = self.ops.add_norm(hidden.contiguous(), None, self.final_norm, self.spec.rms_norm_eps)
        tokens = self.lm_head.first_argmax(x)  # [rows]
        peak = (x.float() * self.lm_head.weight_rows(tokens).float()).sum(dim=-1)  # [rows]: the logit at each argmax
        return tokens, peak < float("inf")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, hidden] (only the rows that sample) -> [rows, vocab] logits in the model's dtype
        (the sampler widens them to float32 where it processes them)."""
        _, x = self.ops.add_norm(hidden.contiguous(), None, self.final_norm, self.spec.rms_norm_eps)
        logits = self.lm_head(x)  # [rows, vocab] ([rows, vocab / N] on a tensor-parallel rank)
        if self.parallel is not None:
            logits = self.parallel.gather_logits(logits)  # [rows, vocab]
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class _Layer:
    """One decoder layer's weights."""

    def __init__(
        self,
        w: Mapping[str, AnyWeight],
        prefix: str,
        quantization: str | None,
        kernels: NativeKernels | None,
        activation: str,
    ) -> None:
        self.input_norm = plain_tensor(w[prefix + "input_norm"], prefix + "input_norm")
        self.post_norm = plain_tensor(w[prefix + "post_norm"], prefix + "post_norm")
        qkv_bias, o_proj_bias = _optional_tensor(w, prefix + "qkv_bias"), _optional_tensor(w, prefix + "o_proj_bias")
        self.qkv = make_projection(w[prefix + "qkv"], qkv_bias, quantization, kernels)
        self.o_proj = make_projection(w[prefix + "o_proj"], o_proj_bias, quantization, kernels)
        self.silu_gate, self.gate_up = _mlp_input(w[prefix + "gate_up"], activation, quantization, kernels)
        """silu_gate: SiLU MLPs with bfloat16 weights on our AMX kernel, or in GGUF blocks: gate/up product and
        activation in one (GGUF: for prompt steps); gate_up: the plain projection otherwise."""
        self.down = make_projection(w[prefix + "down"], None, quantization, kernels)
        self.attn_out_norm = _optional_tensor(w, prefix + "attn_out_norm")
        self.mlp_out_norm = _optional_tensor(w, prefix + "mlp_out_norm")
        self.q_norm = _optional_tensor(w, prefix + "q_norm")
        self.k_norm = _optional_tensor(w, prefix + "k_norm")


def _optional_tensor(w: Mapping[str, AnyWeight], name: str) -> torch.Tensor | None:
    """A norm or bias some models have: a plain tensor, or None where absent."""
    weight = w.get(name)
    return None if weight is None else plain_tensor(weight, name)


def _mlp_input(
    gate_up: AnyWeight, activation: str, quantization: str | None, kernels: NativeKernels | None
) -> tuple[SiluGateProjection | GGUFSiluGate | None, Projection | Int4Projection | GGUFProjection | None]:
    """(the fused gate/up product and activation, or None; the plain gate/up projection, or None where fused).
    Fused for a SiLU MLP whose weights are either dense and kept as they are (no quantization asked) on our AMX
    kernel (SiluGateProjection), or in GGUF blocks (GGUFSiluGate: fused for prompt steps); else the plain projection
    and the separate activation op."""
    if (
        activation == "silu"
        and kernels is not None
        and isinstance(gate_up, torch.Tensor)  # dense and kept as it is (no quantization asked)
        and quantization is None
        and SiluGateProjection.applies(gate_up, kernels)
    ):
        return SiluGateProjection(gate_up, kernels), None
    projection = make_projection(gate_up, None, quantization, kernels)
    if (
        activation == "silu"
        and kernels is not None
        and isinstance(projection, GGUFProjection)
        and GGUFSiluGate.applies(projection)
    ):
        return GGUFSiluGate(projection), None
    return None, projection
