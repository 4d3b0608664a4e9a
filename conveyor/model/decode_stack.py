"""A pure-decode step's decoder layers in one native call, for the plain Llama layer on our AMX kernels.

LlamaModel.forward's Python loop calls ~8 kernels per layer with torch view ops between them; in a decode step,
whose kernels are short, that per-layer Python and dispatch glue is a noticeable share of the step (the difference
between timing every kernel call and timing the whole forward; `conveyor bench decode-step`). csrc/decode_layers.cpp
runs the same kernels in the same order on the same tensors, so the step gives the same bits (tested against the
Python loop, tests/model/test_decode_stack.py); the loop stays the path for everything else: prefill chunks, mixed
steps, other layer kinds, tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from conveyor.model.attention import AttentionBatch
from conveyor.model.layers import Projection, SiluGateProjection
from conveyor.model.model_spec import ModelSpec
from conveyor.model.native import NativeKernels
from conveyor.model.ops import LayerOps
from conveyor.model.rope import RotaryEmbedding


class StackLayer(Protocol):
    """What the stack reads of one decoder layer (llama.py's layers)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection
    o_proj: Projection
    down: Projection
    silu_gate: SiluGateProjection | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None


class StackModel(Protocol):
    """What the stack reads of the model (llama.py's LlamaModel), named here so that this module does not import
    the model that imports it."""

    spec: ModelSpec
    scale: float
    dtype: torch.dtype
    kernels: NativeKernels | None
    ops: LayerOps
    local_rotary: RotaryEmbedding | None

    @property
    def windows(self) -> Sequence[int | None]:
        """Per layer: its sliding window, or None (read-only here, so the model's list satisfies it)."""

    @property
    def layers(self) -> Sequence[StackLayer]: ...


class DecodeStack:
    """The model's per-layer weights as lists for decode_layers; built only where every layer is the plain kind."""

    def __init__(self, model: StackModel, kernels: NativeKernels) -> None:
        spec = model.spec
        self.kernels = kernels
        self.input_norms = [layer.input_norm for layer in model.layers]
        self.post_norms = [layer.post_norm for layer in model.layers]
        self.qkv_tiles = [_packed(layer.qkv) for layer in model.layers]
        self.o_tiles = [_packed(layer.o_proj) for layer in model.layers]
        self.gate_up_tiles = [_packed(layer.silu_gate) for layer in model.layers]
        self.down_tiles = [_packed(layer.down) for layer in model.layers]
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.inner = spec.intermediate_size
        self.eps = spec.rms_norm_eps
        self.scale = model.scale

    @staticmethod
    def applies(model: StackModel) -> bool:
        """Every layer is RMSNorm -> QKV (no bias) -> rotary -> full attention (no soft cap) -> o_proj -> RMSNorm ->
        SiLU gate/up -> down, all on AMX-packed bfloat16 weights, with no per-head or sandwich norms; one rotary
        table; the native decode attention."""
        spec = model.spec
        if model.kernels is None or model.ops.decode_attention is None or model.dtype != torch.bfloat16:
            return False
        if model.local_rotary is not None or spec.attn_logit_softcap is not None:
            return False
        if any(window is not None for window in model.windows):
            return False
        for layer in model.layers:
            if (
                layer.q_norm is not None
                or layer.k_norm is not None
                or layer.attn_out_norm is not None
                or layer.mlp_out_norm is not None
                or layer.silu_gate is None
                or layer.silu_gate.inner != spec.intermediate_size
            ):
                return False
            if any(_tiles(p) is None for p in (layer.qkv, layer.o_proj, layer.down)):
                return False
        return True

    @staticmethod
    def takes(batch: AttentionBatch, num_tokens: int) -> bool:
        """The step is decodes only, in batch order, in one group (as the native decode kernel gets them)."""
        if batch.prefills or len(batch.decode_groups) != 1:
            return False
        group = batch.decode_groups[0]
        return group.in_order and group.block_tables.shape[0] == num_tokens

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """hidden [tokens, hidden] (the embeddings; updated in place), positions [tokens] -> the last layer's output
        [tokens, hidden] (before the final norm), as LlamaModel.forward returns it. The kernel takes the rows of
        the rotary tables at `positions` itself (what rotary.tables(positions, dtype) gives the Python loop)."""
        group = batch.decode_groups[0]
        return self.kernels.decode_layers(
            hidden,
            self.input_norms,
            self.qkv_tiles,
            self.o_tiles,
            self.post_norms,
            self.gate_up_tiles,
            self.down_tiles,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            rotary.cos,
            rotary.sin,
            positions,
            batch.slot_mapping,
            group.block_tables,
            group.context_lens,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.inner,
            self.eps,
            self.scale,
        )


def _packed(projection: object) -> torch.Tensor:
    """The AMX tiles of a projection that applies() accepted (gate/up: interleaved, for the fused product)."""
    if isinstance(projection, SiluGateProjection):
        return projection.tiles
    tiles = _tiles(projection)
    if tiles is None:
        raise ValueError(f"DecodeStack needs AMX-packed bfloat16 projections; got {type(projection).__name__}")
    return tiles


def _tiles(projection: object) -> torch.Tensor | None:
    """A projection's AMX tiles where it is a plain bfloat16 one on our kernel (no bias), else None."""
    if isinstance(projection, Projection) and projection.tiles is not None and projection.bias is None:
        return projection.tiles
    return None
