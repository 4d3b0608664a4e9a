"""int4 weight-only linear layers (CPU): 4-bit weights in groups of 32, bfloat16 activations.

Single-sequence decoding on a CPU is memory-bound: every step reads every weight once. 4-bit
weights are a quarter of bfloat16's bytes, and torch ships a CPU kernel for exactly this
(`_weight_int4pack_mm_for_cpu`). Measured on the 2-core machine, all decoder linears of the
default model at 1 row: int4 5.3 ms, bfloat16 (oneDNN-packed) 17.8 ms, float32 22.1 ms. The
kernel stops paying at about 10 rows (16 rows: int4 28 ms, bfloat16 19 ms), so batches of more
than SMALL_BATCH_ROWS rows (prefill chunks, busy decode steps) use a bfloat16 copy of the very
same dequantized weights: int4 takes more weight memory than bfloat16 and buys latency.
The LM head (tied to the embedding in small models) is kept at 8 bits per weight, one scale per
row (Int8Projection), as llama.cpp keeps a Q4_1 file's Q8_0 output matrix.

Format: per group of 32 input columns, w = (q - 8) * scale + zero with q in 0..15, scale and
zero in bfloat16 (torch's convention). Quantization is asymmetric min/max, the scheme of the GGUF
Q4_1 format: from a Q4_1 file's dequantized weights it recovers the file's own 4-bit codes (each
Q4_1 group uses both q = 0 and q = 15); only its fp16 scale and minimum are rounded to bfloat16.
"""

from __future__ import annotations

import torch

from conveyor.model.layers import Projection

GROUP_SIZE = 32
SMALL_BATCH_ROWS = 8
"""Batches of at most this many rows use the int4 kernel; larger ones the bfloat16 copy."""
_INNER_K_TILES = 2


def can_quantize(weight: torch.Tensor) -> bool:
    """The int4 CPU kernel needs input columns in whole groups and output rows in multiples of 16."""
    return weight.device.type == "cpu" and weight.shape[1] % GROUP_SIZE == 0 and weight.shape[0] % 16 == 0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> codes [out, in] int32 in 0..15, scale and zero [out, in / 32] bfloat16."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)  # [out, groups, 32]
    low, high = groups.amin(-1), groups.amax(-1)  # [out, groups]
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)  # [out, groups]
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15)  # [out, groups, 32]
    zero = low + 8 * scale  # [out, groups]: w = (q - 8) * scale + zero
    return codes.to(torch.int32).reshape(out_features, in_features), scale.bfloat16(), zero.bfloat16()


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """-> W [out, in] float32: exactly the weights the int4 kernel multiplies by."""
    out_features, in_features = codes.shape
    q = codes.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)  # [out, groups, 32]
    w = (q - 8) * scale.float()[..., None] + zero.float()[..., None]  # [out, groups, 32]
    return w.reshape(out_features, in_features)


class Int4Projection:
    """y = x W^T + b with W in int4 for small batches and in bfloat16 (same values) for large ones."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        codes, scale, zero = quantize_int4(weight)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES)  # opaque int4
        self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.dense = Projection(dequantize_int4(codes, scale, zero).to(torch.bfloat16), self.bias)
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] bfloat16 -> [tokens, out] bfloat16."""
        if x.shape[0] > SMALL_BATCH_ROWS:
            return self.dense(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


LM_HEAD_INT8_ROWS = 2
"""Rows up to which the LM head multiplies int8 weights (measured at 1 row: 0.95 ms against 1.37 ms in
bfloat16 for 576 -> 49,152; at 4 rows the int8 kernel is already slower: 1.70 against 1.40 ms)."""


class Int8Projection:
    """y = x W^T, W in int8 with one bfloat16 scale per output row (symmetric), for the LM head of an
    int4 model (as GGUF files keep the output/embedding matrix at 8 bits): torch's
    `_weight_int8pack_mm` for up to LM_HEAD_INT8_ROWS rows, a bfloat16 copy of the same dequantized
    weights for more."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()  # [out, in]
        self.scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)  # [out]
        self.codes = torch.round(w / self.scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
        self.dense = Projection(dequantize_int8(self.codes, self.scale).to(torch.bfloat16))
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] bfloat16 -> [rows, out] bfloat16."""
        if x.shape[0] > LM_HEAD_INT8_ROWS:
            return self.dense(x)
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int8, scale [out] -> W [out, in] float32: the weights the int8 kernel multiplies by."""
    return codes.float() * scale.float()[:, None]


def make_lm_head(weight: torch.Tensor, quantization: str | None) -> Projection | Int8Projection:
    """The LM head: int8 rows beside int4 decoder weights, else the dtype's fastest layout."""
    if quantization == "int4" and weight.device.type == "cpu":
        return Int8Projection(weight)
    return Projection(weight)


def make_projection(weight: torch.Tensor, bias: torch.Tensor | None,
                    quantization: str | None) -> Projection | Int4Projection:
    """The decoder's linear layers: int4 where asked and the shape allows it, else the dtype's fastest layout."""
    if quantization == "int4" and can_quantize(weight):
        return Int4Projection(weight, bias)
    return Projection(weight, bias)
