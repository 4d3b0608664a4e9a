"""int4 weight-only linear layers (CPU): 4-bit weights in groups of 32, bfloat16 activations.

Single-sequence decoding on a CPU is memory-bound: every step reads every weight once. 4-bit
weights are a quarter of bfloat16's bytes. Two kernels multiply them: the native one
(csrc/quant_linear.cpp, on CPUs with AVX-512 BF16) and torch's (`_weight_int4pack_mm_for_cpu`)
elsewhere. At one row both are several times faster than bfloat16 (they read a quarter of the
bytes); as rows grow, unpacking the 4-bit codes again for every row costs more than the bytes saved,
and from about 8 rows bfloat16 is faster, so batches of more than SMALL_BATCH_ROWS rows (prefill
chunks, busy decode steps) use a bfloat16 copy of the very same dequantized weights: int4 takes
more weight memory than bfloat16 and buys latency. Tuned with `conveyor bench decode-step --num-seqs N`.
The LM head (tied to the embedding in small models) is kept at 8 bits per weight, one scale per
row (Int8Projection), as llama.cpp keeps a Q4_1 file's Q8_0 output matrix.

Format: per group of 32 input columns, w = (q - 8) * scale + zero with q in 0..15, scale and
zero in bfloat16 (torch's convention). Quantization is asymmetric min/max, the scheme of the GGUF
Q4_1 format: from a Q4_1 file's dequantized weights it recovers the file's own 4-bit codes (each
Q4_1 group uses both q = 0 and q = 15); only its fp16 scale and minimum are rounded to bfloat16.
"""

from __future__ import annotations

import logging

import torch

from conveyor.errors import ConfigError
from conveyor.model.gguf_projection import GGUFProjection
from conveyor.model.gguf_quant import (
    FORMATS,
    QUANTIZATIONS,
    AnyWeight,
    QuantizedWeight,
    dense,
    kernels_keep_compact,
    quantize,
)
from conveyor.model.layers import Projection
from conveyor.model.native import NativeKernels

GROUP_SIZE = 32
SMALL_BATCH_ROWS = 8
"""Batches of at most this many rows use the int4 kernel; larger ones the bfloat16 copy."""
_INNER_K_TILES = 2
logger = logging.getLogger(__name__)


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


def pack_int4_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes [out, in] 0..15, scale and zero [out, in / 32] bfloat16 -> [out / 16, in / 32, 320] uint8, the
    native kernel's layout (csrc/quant_linear.cpp): per 16 rows x 32 columns, 8 quads of 32 bytes (quad t,
    byte 2r + p: row r's column 4t + p in the low nibble, 4t + 2 + p in the high one), 16 scales, 16 zeros."""
    out_features, in_features = codes.shape
    blocks, groups = out_features // 16, in_features // GROUP_SIZE
    c = codes.to(torch.uint8).reshape(blocks, 16, groups, 8, 2, 2)  # [blocks, row, group, quad, half, pair]
    nibbles = c[..., 0, :] | (c[..., 1, :] << 4)  # [blocks, row, group, quad, pair]
    code_bytes = nibbles.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256)  # [blocks, group, quad * row * pair]
    scale_bytes = scale.reshape(blocks, 16, groups).transpose(1, 2).contiguous().view(torch.uint8)  # [.., .., 32]
    zero_bytes = zero.reshape(blocks, 16, groups).transpose(1, 2).contiguous().view(torch.uint8)  # [.., .., 32]
    return torch.cat([code_bytes, scale_bytes, zero_bytes], dim=-1).contiguous()  # [blocks, groups, 320]


def pack_int8_rows(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int8 -> [out / 16, in, 16]: 16 output rows side by side (csrc/quant_linear.cpp)."""
    out_features, in_features = codes.shape
    return codes.reshape(out_features // 16, 16, in_features).transpose(1, 2).contiguous()


def fast_native(kernels: NativeKernels | None) -> NativeKernels | None:
    """The native kernels when their quantized products are vectorized on this CPU, else None (torch's)."""
    return kernels if kernels is not None and kernels.quant_linear_vectorized() else None


class Int4Projection:
    """y = x W^T + b with W in int4 for small batches and in bfloat16 (same values) for large ones."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels: NativeKernels | None = None
    ) -> None:
        codes, scale, zero = quantize_int4(weight)
        self.kernels = fast_native(kernels)
        self.blocks: torch.Tensor | None = None  # [out / 16, in / 32, 320] uint8, the native kernel's
        self.packed: torch.Tensor | None = None  # torch's opaque int4 layout
        if self.kernels is not None:
            self.blocks = pack_int4_blocks(codes, scale, zero)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES)
            self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.dense = Projection(dequantize_int4(codes, scale, zero).to(torch.bfloat16), self.bias)
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] bfloat16 -> [tokens, out] bfloat16."""
        if x.shape[0] > SMALL_BATCH_ROWS:
            return self.dense(x)
        x = x.contiguous()  # both int4 kernels read rows in place
        if self.kernels is not None:
            assert self.blocks is not None  # packed for the native kernel in __init__
            return self.kernels.int4_linear(x, self.blocks, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


LM_HEAD_INT8_ROWS = 2
"""Rows up to which the LM head multiplies int8 weights with torch's kernel (faster than bfloat16 at a row or two,
which read half the bytes; already slower at 4 rows). Tuned with `conveyor bench decode-step --num-seqs N`."""
LM_HEAD_INT8_ROWS_NATIVE = 4
"""The same with the native kernel, which stays ahead of bfloat16 up to 4 rows and falls behind by 8 (tuned
the same way)."""


class Int8Projection:
    """y = x W^T, W in int8 with one bfloat16 scale per output row (symmetric), for the LM head of an
    int4 model (as GGUF files keep the output/embedding matrix at 8 bits): the native kernel for up to
    LM_HEAD_INT8_ROWS_NATIVE rows (torch's `_weight_int8pack_mm` for up to LM_HEAD_INT8_ROWS where it is
    not vectorized), a bfloat16 copy of the same dequantized weights for more."""

    def __init__(self, weight: torch.Tensor, kernels: NativeKernels | None = None) -> None:
        w = weight.float()  # [out, in]
        self.scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)  # [out]
        codes = torch.round(w / self.scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
        self.dense = Projection(dequantize_int8(codes, self.scale).to(torch.bfloat16))
        self.out_features = weight.shape[0]
        self.kernels = fast_native(kernels) if self.out_features % 16 == 0 else None
        self.max_rows = LM_HEAD_INT8_ROWS if self.kernels is None else LM_HEAD_INT8_ROWS_NATIVE
        if self.kernels is not None:
            self.codes = pack_int8_rows(codes)  # [out / 16, in, 16]
            self.scale_f32 = self.scale.float()  # [out]
        else:
            self.codes = codes  # [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] bfloat16 -> [rows, out] bfloat16."""
        if x.shape[0] > self.max_rows:
            return self.dense(x)
        x = x.contiguous()
        if self.kernels is not None:
            return self.kernels.int8_linear(x, self.codes, self.scale_f32)
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)

    def dequantized(self) -> torch.Tensor:
        """-> W [out, in] float32: exactly the weights this head multiplies by."""
        codes = self.codes if self.kernels is None else self.codes.transpose(1, 2).reshape(self.out_features, -1)
        return dequantize_int8(codes, self.scale)


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int8, scale [out] -> W [out, in] float32: the weights the int8 kernel multiplies by."""
    return codes.float() * scale.float()[:, None]


def make_lm_head(
    weight: AnyWeight, quantization: str | None, kernels: NativeKernels | None = None
) -> Projection | Int8Projection | GGUFProjection:
    """The LM head: GGUF blocks as loaded, or Q8_0 with quantization='q*'; int8 rows beside int4 decoder
    weights; else the dtype's fastest layout."""
    if quantization == "int4_latency":
        weight = dense(weight)  # the latency mode re-quantizes what the file holds
    if not isinstance(weight, torch.Tensor):
        return GGUFProjection(weight, None, _compact_kernels(kernels, weight))
    if quantization in QUANTIZATIONS:
        return GGUFProjection(quantize_for_load(weight, "q8_0", kernels), None, _compact_kernels(kernels, weight))
    if quantization == "int4_latency" and weight.device.type == "cpu":
        return Int8Projection(weight, kernels)
    return Projection(weight, None, kernels)


def make_projection(
    weight: AnyWeight, bias: torch.Tensor | None, quantization: str | None, kernels: NativeKernels | None = None
) -> Projection | Int4Projection | GGUFProjection:
    """The decoder's linear layers: GGUF blocks as loaded; quantized into a GGUF format where asked (q*);
    int4 where asked and the shape allows it; else the dtype's fastest layout."""
    if quantization == "int4_latency":
        weight = dense(weight)  # the latency mode re-quantizes what the file holds
    if not isinstance(weight, torch.Tensor):
        return GGUFProjection(weight, bias, _compact_kernels(kernels, weight))
    if quantization in QUANTIZATIONS:
        return GGUFProjection(quantize_for_load(weight, quantization, kernels), bias, _compact_kernels(kernels, weight))
    if quantization == "int4_latency" and can_quantize(weight):
        return Int4Projection(weight, bias, kernels)
    return Projection(weight, bias, kernels)


K_QUANT_FALLBACKS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
"""What a K-quant becomes for a weight whose input width is not a multiple of 256 (llama.cpp's choice)."""


def quantize_for_load(weight: torch.Tensor, quantization: str, kernels: NativeKernels | None) -> QuantizedWeight:
    """A checkpoint's weight [out, in] -> GGUF blocks of the asked format (quantization='q4_k' etc.)."""
    reason = kernels_keep_compact(kernels, weight.device, weight.dtype)
    if reason is not None:
        raise ConfigError(
            f"quantization={quantization!r} needs the native GGUF kernels, but {reason}; leave "
            f"quantization unset, or use kernels='auto' on a CPU with AVX2 + FMA or AVX-512 VNNI"
        )
    kind = quantization.upper()
    if weight.shape[1] % FORMATS[kind].block and kind in K_QUANT_FALLBACKS:
        fallback = K_QUANT_FALLBACKS[kind]
        logger.warning(
            "quantization=%r: a weight %s has %d input columns, not a multiple of 256; it is "
            "quantized to %s instead (as llama.cpp does)",
            quantization,
            tuple(weight.shape),
            weight.shape[1],
            fallback,
        )
        kind = fallback
    return quantize(weight, kind)


def _compact_kernels(kernels: NativeKernels | None, weight: AnyWeight) -> NativeKernels:
    """The kernels for weights kept compact (place_weights / quantize_for_load checked that they apply)."""
    assert kernels is not None, "GGUF blocks reach a projection only where the native kernels multiply them"
    return kernels
