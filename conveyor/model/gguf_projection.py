"""A projection whose weight stays in GGUF blocks (gguf_quant.QuantizedWeight), or a RowStack of such parts.

Few rows (single-request decoding) go to the kernel that multiplies each weight row by every activation row
(int8 dot products over activations rounded to int8 per 32 or 256 columns, as llama.cpp's Q8 activations; or the
row dequantized once for types without them), all parts of a row stack in one call; more than ROWS_MAX
rows (prefill chunks, busy decode steps) of bfloat16 activations to the AMX kernel where the CPU has AMX-BF16
(each thread dequantizes 32 weight rows to bfloat16, csrc/gguf_amx.cpp, and multiplies them on tiles,
csrc/amx_product.cpp), again all parts of a row stack (a fused QKV of Q4_K and Q6_K) in one call, else (no
AMX, or float32 activations) to the one that dequantizes a tile of weights at a time into a thread's scratch
and runs torch's GEMM on it, part by part. Which one is logged once per process.

From PACKED_ROWS_MIN rows on (PACKED_ROWS_MIN_WIDE for inputs wider than 2048; prompt steps), the AMX path first
dequantizes the whole stack into bfloat16 tiles in the layout of a bfloat16 checkpoint's packed weights
(csrc/gguf_linear.cpp's gguf_pack_tiles, into a scratch each forward thread reuses for every projection) and
multiplies them with the bfloat16 checkpoint's kernel; a SiLU MLP's gate/up stack then also applies the activation
inside that product (GGUFSiluGate), as SiluGateProjection does for bfloat16 weights. The same bits as the per-chunk
path (tests/model/test_gguf_quant.py).
"""

from __future__ import annotations

import functools
import logging
import threading

import torch

from conveyor.model.gguf_quant import QuantizedWeight, RowStack
from conveyor.model.layers import Projection
from conveyor.model.native import NativeKernels

ROWS_MAX = 4
"""Activation rows up to which the row kernel is used: it streams the quantized weights once per row, which beats
the tiled product only while rows are few. Tuned with `conveyor bench decode-step --num-seqs N` on a GGUF model."""

ROWS_MAX_FLOAT32 = 32
"""The same for float32 activations (CPUs without native bfloat16): the tiled product then multiplies float32
weights dequantized at every call, and the int8 dot products (each group of 4 activation rows sharing one unpacking
of the weights) beat it up to about this many rows. Tuned as ROWS_MAX is, on a float32 model: `conveyor bench
decode-step --num-seqs N`."""


PACKED_ROWS_MIN = 512
"""Activation rows from which a bfloat16 AMX product of an input up to PANEL_COLUMNS wide first dequantizes the
weights into packed bfloat16 tiles (once per call) instead of once per 256-row chunk of rows inside the product.
Packing costs a pass over the weights and a scratch buffer, so it pays only once the product has at least two
chunks of rows to share it; below this, per-chunk dequantization was as fast or faster (Q4_K, Q6_K and Q4_1
weights alike). Tuned with `conveyor bench latency --input-len N` on a GGUF model (prefill chunks of N rows)."""

PACKED_ROWS_MIN_WIDE = 257
"""The same for inputs wider than PANEL_COLUMNS (a down projection): from two chunks of rows on, where the product
would dequantize every block once per chunk, packing already pays (tuned as PACKED_ROWS_MIN is)."""

PANEL_COLUMNS = 2048
"""Input columns the AMX product takes at a time (amx_product.cpp's kPanelValues)."""


def rows_max(x: torch.Tensor) -> int:
    """Activation rows up to which x's product takes the row kernel (ROWS_MAX, or ROWS_MAX_FLOAT32)."""
    return ROWS_MAX_FLOAT32 if x.dtype == torch.float32 else ROWS_MAX


def packed_rows_min(in_features: int) -> int:
    """Activation rows from which a product with this input width takes the packed path."""
    return PACKED_ROWS_MIN_WIDE if in_features > PANEL_COLUMNS else PACKED_ROWS_MIN


logger = logging.getLogger(__name__)


class _PackScratch(threading.local):
    """The bfloat16 tiles a forward thread dequantizes a projection's weights into (grown to the largest stack,
    reused by every projection: one product at a time per thread)."""

    buffer: torch.Tensor | None = None


_scratch = _PackScratch()


def packed_tiles(
    kernels: NativeKernels,
    blocks: list[torch.Tensor],
    kinds: list[int],
    in_features: int,
    out_features: int,
    gate_up: bool,
) -> torch.Tensor:
    """The stack dequantized into this thread's scratch as pack_bf16_tiles lays it out (interleave_gate_up's rows
    where gate_up): -> tiles [rows / 16 rounded up to even, in / 32, 16, 32], valid until the next call here."""
    row_tiles = -(-out_features // 32) * 2
    numel = row_tiles * in_features * 16
    if _scratch.buffer is None or _scratch.buffer.numel() < numel:
        _scratch.buffer = None  # the old one freed before the larger is taken
        _scratch.buffer = torch.empty(numel, dtype=torch.bfloat16)
    tiles = _scratch.buffer[:numel].view(row_tiles, in_features // 32, 16, 32)
    kernels.gguf_pack_tiles(blocks, kinds, in_features, gate_up, tiles)
    return tiles


@functools.cache
def amx_rows(kernels: NativeKernels) -> bool:
    """Whether bfloat16 products of more than ROWS_MAX rows run on AMX tiles here (logged on the first call)."""
    amx = kernels.gguf_amx_available()
    if amx:
        logger.info("GGUF products of more than %d bfloat16 rows: AMX-BF16 tiles (gguf_linear_amx)", ROWS_MAX)
    else:
        logger.info(
            "GGUF products of more than %d rows: dequantized tiles into torch's GEMM (gguf_linear_tiles); "
            "this CPU or kernel offers no AMX-BF16",
            ROWS_MAX,
        )
    return amx


class GGUFProjection:
    """y = x W^T + b with W in GGUF blocks (x: float32 or bfloat16; y in x's dtype)."""

    def __init__(self, weight: QuantizedWeight | RowStack, bias: torch.Tensor | None, kernels: NativeKernels) -> None:
        parts = weight.parts if isinstance(weight, RowStack) else (weight,)
        self.parts: list[QuantizedWeight | Projection] = [
            p if isinstance(p, QuantizedWeight) else Projection(p, None, kernels) for p in parts
        ]
        self.kernels = kernels
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        compact = [p for p in self.parts if isinstance(p, QuantizedWeight)]
        # all parts in blocks: few rows take one call for the whole stack (x quantized once, one output)
        self.stacked: tuple[list[torch.Tensor], list[int]] | None = (
            ([p.blocks for p in compact], [p.type_id for p in compact]) if len(compact) == len(self.parts) else None
        )

    def _part(self, part: QuantizedWeight | Projection, x: torch.Tensor) -> torch.Tensor:
        if isinstance(part, Projection):
            return part(x)
        if x.shape[0] <= rows_max(x):
            return self.kernels.gguf_linear_rows(x, part.blocks, part.type_id, part.in_features, int8_float32=True)
        if x.dtype == torch.bfloat16 and amx_rows(self.kernels):
            product = self.kernels.gguf_linear_amx
        else:
            product = self.kernels.gguf_linear_tiles
        return product(x, part.blocks, part.type_id, part.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""
        x = x.contiguous()
        if self.stacked is not None and x.shape[0] <= rows_max(x):
            y = self.kernels.gguf_linear_rows_parts(
                x, *self.stacked, self.in_features, int8_float32=True
            )  # [tokens, out]
            return y if self.bias is None else y + self.bias
        if self.packs(x):
            y = self.kernels.bf16_linear_amx(x, self.packed(gate_up=False), self.out_features)  # [tokens, out]
            return y if self.bias is None else y + self.bias
        if self.stacked is not None and self.multiplies_blocks(x):
            y = self.kernels.gguf_linear_amx_parts(x, *self.stacked, self.in_features)  # [tokens, out]
            return y if self.bias is None else y + self.bias
        outs = [self._part(p, x) for p in self.parts]  # each [tokens, part rows]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # [tokens, out]
        return y if self.bias is None else y + self.bias

    def packs(self, x: torch.Tensor) -> bool:
        """Whether a product with x takes the packed path: all parts in blocks, packed_rows_min bfloat16 rows or
        more, AMX here."""
        return (
            self.stacked is not None
            and x.dtype == torch.bfloat16
            and x.shape[0] >= packed_rows_min(self.in_features)
            and amx_rows(self.kernels)
        )

    def multiplies_blocks(self, x: torch.Tensor) -> bool:
        """Whether a product with x (short of packed_rows_min rows) dequantizes the stack block by block on AMX tiles
        (gguf_linear_amx_parts): all parts in blocks, more than ROWS_MAX bfloat16 rows, AMX here."""
        return (
            self.stacked is not None and x.shape[0] > ROWS_MAX and x.dtype == torch.bfloat16 and amx_rows(self.kernels)
        )

    def packed(self, gate_up: bool) -> torch.Tensor:
        """The stack in this thread's scratch of packed tiles (packed_tiles), gate and up rows interleaved where
        gate_up."""
        assert self.stacked is not None
        return packed_tiles(self.kernels, *self.stacked, self.in_features, self.out_features, gate_up)

    def unpacked(self) -> torch.Tensor:
        """-> W [out, in] float32, dequantized by the `gguf` package (the values the float paths multiply by;
        the int8 dot products of few-row products round the activations, not these)."""
        return torch.cat(
            [p.dequantize() if isinstance(p, QuantizedWeight) else p.unpacked().float() for p in self.parts]
        )


class GGUFSiluGate:
    """silu(x Wg^T) * (x Wu^T) for a SiLU MLP's stacked [Wg; Wu] in GGUF blocks: from packed_rows_min bfloat16 rows
    on (AMX), dequantized into packed tiles with the gate and up rows interleaved and multiplied with the activation
    applied inside the product (bf16_silu_gate_amx: no [tokens, 2 inner] output written and read back); from
    ROWS_MAX + 1 rows below that (AMX), each block of weights dequantized in the same interleaved order and the
    activation applied as the product stores (gguf_silu_gate_amx_parts); otherwise the projection, then the native
    silu_and_mul, as the layer computes it without this. The same bits every way (the fused products round as
    bf16_linear_amx / gguf_linear_amx_parts then silu_and_mul would)."""

    def __init__(self, projection: GGUFProjection) -> None:
        self.projection = projection
        self.inner = projection.out_features // 2

    @staticmethod
    def applies(projection: GGUFProjection) -> bool:
        """All parts in blocks, no bias, and halves that split into 16-row tiles."""
        return projection.stacked is not None and projection.bias is None and projection.out_features % 32 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden] -> [tokens, inner]."""
        p = self.projection
        if p.packs(x):
            return p.kernels.bf16_silu_gate_amx(x.contiguous(), p.packed(gate_up=True), self.inner)
        if p.stacked is not None and p.multiplies_blocks(x):  # a busy decode step: dequantized block by block, fused
            return p.kernels.gguf_silu_gate_amx_parts(x.contiguous(), *p.stacked, p.in_features)
        return p.kernels.silu_and_mul(p(x))

    def unpacked(self) -> torch.Tensor:
        """-> [Wg; Wu] [2 inner, hidden] float32 (GGUFProjection.unpacked)."""
        return self.projection.unpacked()
