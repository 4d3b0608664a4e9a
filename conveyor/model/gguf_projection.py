"""A projection whose weight stays in GGUF blocks (gguf_quant.QuantizedWeight), or a RowStack of such parts.

Few rows (single-request decoding) go to the kernel that multiplies each weight row by every activation row
(int8 dot products, or the row dequantized once), all parts of a row stack in one call; more than ROWS_MAX
rows (prefill chunks, busy decode steps) of bfloat16 activations to the AMX kernel where the CPU has AMX-BF16
(each thread dequantizes 32 weight rows to bfloat16, csrc/gguf_amx.cpp, and multiplies them on tiles,
csrc/amx_product.cpp), again all parts of a row stack (a fused QKV of Q4_K and Q6_K) in one call, else (no
AMX, or float32 activations) to the one that dequantizes a tile of weights at a time into a thread's scratch
and runs torch's GEMM on it, part by part. Which one is logged once per process.
"""

from __future__ import annotations

import functools
import logging

import torch

from conveyor.model.gguf_quant import QuantizedWeight, RowStack
from conveyor.model.layers import Projection
from conveyor.model.native import NativeKernels

ROWS_MAX = 4
"""Activation rows up to which the row kernel is used (see benchmarks/RESULTS.md, GGUF kernels)."""


logger = logging.getLogger(__name__)


@functools.cache
def amx_rows(kernels: NativeKernels) -> bool:
    """Whether bfloat16 products of more than ROWS_MAX rows run on AMX tiles here (logged on the first call)."""
    amx = kernels.gguf_amx_available()
    if amx:
        logger.info("GGUF products of more than %d bfloat16 rows: AMX-BF16 tiles (gguf_linear_amx)", ROWS_MAX)
    else:
        logger.info("GGUF products of more than %d rows: dequantized tiles into torch's GEMM (gguf_linear_tiles); "
                    "this CPU or kernel offers no AMX-BF16", ROWS_MAX)
    return amx


class GGUFProjection:
    """y = x W^T + b with W in GGUF blocks (x: float32 or bfloat16; y in x's dtype)."""

    def __init__(self, weight: QuantizedWeight | RowStack, bias: torch.Tensor | None, kernels: NativeKernels) -> None:
        parts = weight.parts if isinstance(weight, RowStack) else (weight,)
        self.parts: list[QuantizedWeight | Projection] = [
            p if isinstance(p, QuantizedWeight) else Projection(p, None, kernels) for p in parts]
        self.kernels = kernels
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        compact = [p for p in self.parts if isinstance(p, QuantizedWeight)]
        # all parts in blocks: few rows take one call for the whole stack (x quantized once, one output)
        self.stacked: tuple[list[torch.Tensor], list[int]] | None = (
            ([p.blocks for p in compact], [p.type_id for p in compact]) if len(compact) == len(self.parts) else None)

    def _part(self, part: QuantizedWeight | Projection, x: torch.Tensor) -> torch.Tensor:
        if isinstance(part, Projection):
            return part(x)
        if x.shape[0] <= ROWS_MAX:
            product = self.kernels.gguf_linear_rows
        elif x.dtype == torch.bfloat16 and amx_rows(self.kernels):
            product = self.kernels.gguf_linear_amx
        else:
            product = self.kernels.gguf_linear_tiles
        return product(x, part.blocks, part.type_id, part.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""
        x = x.contiguous()
        if self.stacked is not None and x.shape[0] <= ROWS_MAX:
            y = self.kernels.gguf_linear_rows_parts(x, *self.stacked, self.in_features)  # [tokens, out]
            return y if self.bias is None else y + self.bias
        if self.stacked is not None and x.dtype == torch.bfloat16 and amx_rows(self.kernels):
            y = self.kernels.gguf_linear_amx_parts(x, *self.stacked, self.in_features)  # [tokens, out]
            return y if self.bias is None else y + self.bias
        outs = [self._part(p, x) for p in self.parts]  # each [tokens, part rows]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # [tokens, out]
        return y if self.bias is None else y + self.bias

    def unpacked(self) -> torch.Tensor:
        """-> W [out, in] float32, dequantized by the `gguf` package (the values the float paths multiply by;
        the int8 dot products of bfloat16 activations round the activations, not these)."""
        return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.unpacked().float()
                          for p in self.parts])
