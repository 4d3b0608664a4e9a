"""The decoder's small per-layer ops, from torch or from the native CPU kernels: chosen once at load, so the
forward pass reads the same either way."""

from __future__ import annotations

from typing import Protocol

import torch

from conveyor.model.attention import DecodeAttention, PrefillAttention
from conveyor.model.layers import apply_rotary, rms_norm, silu_and_mul
from conveyor.model.model_spec import ModelSpec
from conveyor.model.native import NativeKernels


class LayerOps(Protocol):
    decode_attention: DecodeAttention | None
    """The native decode attention, or None for the torch gather + SDPA path."""
    prefill_attention: PrefillAttention | None
    """The native prefill attention (AMX), or None for torch's SDPA chunk by chunk."""

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (h + delta, rms_norm(h + delta) * weight); h may be updated in place."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[tokens, 2 * inter] -> silu(gate) * up [tokens, inter]."""
        ...

    def rotate_and_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        spec: ModelSpec,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """qkv [tokens, q_size + 2 * kv_size]; cos, sin [tokens, 1, head_dim] -> (q [tokens, heads, d],
        k [tokens, kv_heads, d], whether K and V are already in the cache)."""
        ...


class TorchOps:
    decode_attention: DecodeAttention | None = None
    prefill_attention: PrefillAttention | None = None

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def rotate_and_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        spec: ModelSpec,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        n = qkv.shape[0]
        # Q and K heads side by side in qkv: rotated in one pass; paged_attention writes K and V
        qk = qkv[:, : spec.q_size + spec.kv_size].view(n, spec.num_heads + spec.num_kv_heads, spec.head_dim)
        qk = apply_rotary(qk, cos, sin)  # [tokens, heads + kv_heads, head_dim]
        return qk[:, : spec.num_heads], qk[:, spec.num_heads :], False


class NativeOps:
    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels
        self.decode_attention: DecodeAttention | None = kernels.decode_attention
        self.prefill_attention: PrefillAttention | None = (
            kernels.prefill_attention if kernels.prefill_attention_available() else None
        )

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self.kernels.add_rms_norm(h, delta, weight, eps)  # adds delta into h in place

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up)

    def rotate_and_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        spec: ModelSpec,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        n = qkv.shape[0]
        qk = self.kernels.rotary_and_cache(
            qkv, cos.view(n, -1), sin.view(n, -1), k_cache, v_cache, slot_mapping, spec.num_heads, spec.num_kv_heads
        )  # [tokens, heads + kv_heads, d]
        return qk[:, : spec.num_heads], qk[:, spec.num_heads :], True


def layer_ops(kernels: NativeKernels | None) -> LayerOps:
    return TorchOps() if kernels is None else NativeOps(kernels)
