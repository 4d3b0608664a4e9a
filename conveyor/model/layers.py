"""Building blocks of Llama-family models: projections, RMSNorm, rotate-half, gated MLP activation."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from conveyor.model.native import NativeKernels


class Projection:
    """y = x W^T + b for a weight W [out, in], stored in the layout that multiplies fastest.

    - float32 with the native kernels (csrc/f32_linear.cpp): W in 32-column panels, multiplied by
      our kernel up to F32_NATIVE_MAX_ROWS rows, where it beats torch's GEMM by streaming each panel once
      for all rows; larger prefill chunks rebuild W^T from the panels for torch's GEMM (as fast as
      torch's GEMM with W^T kept, which would be a second float32 copy of every weight);
    - float32 without them: oneDNN's skinny GEMM reads W [out, in] slower than a plain matmul against
      W^T stored contiguous [in, out], so W is stored transposed;
    - bfloat16 on a CPU with AMX and the native kernels: W packed once at load in AMX's tile layout
      (pack_bf16_tiles) and multiplied by our kernel (csrc/amx_product.cpp) at every row count,
      the weights read in place and prefetched where the row count makes it pay. It beats oneDNN's packed
      product at decode's few rows, and is a little behind it on large prefill chunks, where one layout for
      every row count (no second copy of the weights) is worth that;
    - bfloat16 on a CPU with native bf16 (AVX-512 BF16 / AMX) otherwise (no native kernels,
      kernels='torch', a bias, or an input width not a multiple of 32): F.linear re-packs W into
      oneDNN's blocked layout on every call. Packing once at load (`_reorder_linear_weight`)
      gives bit-identical results and saves that repacking at every call.
    Only one layout is kept: keeping the plain W too would double the weight memory.
    `conveyor bench decode-step` and `conveyor bench throughput` compare the paths (`kernels='torch'`).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels: NativeKernels | None = None
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.tiles = pack_bf16_tiles(weight) if _amx_bf16(weight, bias, kernels) else None  # [out/16, in/32, 16, 32]
        self.packed = _pack_for_onednn(weight) if self.tiles is None else None  # opaque oneDNN tensor, or None
        native_f32 = self.tiles is None and self.packed is None and _native_f32(weight, kernels)
        self.kernels = kernels if self.tiles is not None or native_f32 else None
        self.panels = pack_f32_panels(weight) if native_f32 else None  # [ceil(out / 32), in, 32]
        if self.panels is not None and bias is not None:
            self.bias = bias.contiguous()
        packed_once = self.tiles is not None or self.packed is not None or self.panels is not None
        self.transposed = not packed_once and weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.weight: torch.Tensor | None = (
            None if packed_once else (weight.t().contiguous() if self.transposed else weight)
        )  # [in, out] or [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""
        if self.tiles is not None:
            assert self.kernels is not None
            return self.kernels.bf16_linear_amx(x, self.tiles, self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
        if self.panels is not None:
            if x.shape[0] <= F32_NATIVE_MAX_ROWS:
                assert self.kernels is not None
                return self.kernels.f32_linear(x.contiguous(), self.panels, self.out_features, self.bias)
            unpacked = self.panels.transpose(0, 1).reshape(self.in_features, -1)[:, : self.out_features]  # [in, out]
            return x @ unpacked if self.bias is None else torch.addmm(self.bias, x, unpacked)
        weight = self.weight
        assert weight is not None
        if not self.transposed:
            return F.linear(x, weight, self.bias)
        if self.bias is not None:
            return torch.addmm(self.bias, x, weight)
        return x @ weight

    @property
    def computes_argmax(self) -> bool:
        """Whether first_argmax runs here: bfloat16 weights in AMX tiles on our kernel."""
        return self.tiles is not None

    def first_argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens] int64: each row's first largest value of self(x) (the first NaN where a row
        has one: torch's max(dim=-1).indices), without writing self(x) (a greedy step's LM head: the logits are
        never stored and read back). Only where computes_argmax."""
        if self.tiles is None or self.kernels is None:
            raise ValueError(
                "first_argmax needs bfloat16 weights packed in AMX tiles on the native kernels; this "
                "projection keeps another layout: take the argmax of its output instead"
            )
        return self.kernels.bf16_linear_argmax_amx(x, self.tiles, self.out_features)

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """index [k] int64 -> W[index] [k, in], the rows of those outputs (read in place from the AMX tiles: the
        LM head's value at each argmax first_argmax found, without the logits)."""
        if self.tiles is not None:
            row_tiles, k_tiles = self.tiles.shape[:2]
            pairs = self.tiles.view(row_tiles, k_tiles, _TILE_K // 2, _TILE_ROWS, 2)  # [out/16, in/32, pair, row, 2]
            picked = pairs[index // _TILE_ROWS, :, :, index % _TILE_ROWS, :]  # [k, in / 32, pair, 2]
            return picked.reshape(index.shape[0], self.in_features)
        return self.unpacked()[index]

    def unpacked(self) -> torch.Tensor:
        """-> W [out, in] with the values this projection multiplies by (a view or a copy); raises for the
        opaque oneDNN pack."""
        if self.tiles is not None:
            return unpack_bf16_tiles(self.tiles, self.out_features)
        if self.panels is not None:
            return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]
        if self.weight is None:
            raise ValueError("this projection holds only oneDNN's packed bfloat16 weights")
        return self.weight.t() if self.transposed else self.weight


class SiluGateProjection:
    """silu(x Wg^T) * (x Wu^T) for the gated MLP's stacked [Wg; Wu] [2 inner, hidden], in one AMX product whose
    blocks of 32 weight rows each hold 16 gate rows and their 16 up rows (interleave_gate_up), so that the
    activation is applied to the accumulators before anything is stored: no [tokens, 2 inner] output written and
    read back. The same bits as Projection followed by the silu_and_mul op (tests/model/test_bf16_amx.py), in less
    time and memory traffic: the [tokens, 2 inner] intermediate is what a large prefill chunk's MLP spends most
    of its stores and loads on."""

    def __init__(self, weight: torch.Tensor, kernels: NativeKernels) -> None:
        self.inner = weight.shape[0] // 2
        self.in_features = weight.shape[1]
        self.tiles = pack_bf16_tiles(interleave_gate_up(weight))  # [2 inner / 16, in / 32, 16, 32]
        self.kernels = kernels

    @staticmethod
    def applies(weight: torch.Tensor, kernels: NativeKernels | None) -> bool:
        """Our AMX kernel multiplies W (as Projection would pick it) and its halves split into 16-row tiles."""
        return _amx_bf16(weight, None, kernels) and weight.shape[0] % (2 * _TILE_ROWS) == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden] -> [tokens, inner]."""
        return self.kernels.bf16_silu_gate_amx(x, self.tiles, self.inner)

    def unpacked(self) -> torch.Tensor:
        """-> [Wg; Wu] [2 inner, hidden] as given (a copy)."""
        interleaved = unpack_bf16_tiles(self.tiles, 2 * self.inner)  # [2 inner, hidden]
        halves = interleaved.view(-1, 2, _TILE_ROWS, self.in_features)  # [inner / 16, gate | up, 16, hidden]
        return halves.transpose(0, 1).reshape(2 * self.inner, self.in_features)


def interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """[Wg; Wu] [2 inner, in] (inner a multiple of 16) -> rows Wg[0:16], Wu[0:16], Wg[16:32], Wu[16:32], ..."""
    inner, in_features = weight.shape[0] // 2, weight.shape[1]
    halves = weight.reshape(2, inner // _TILE_ROWS, _TILE_ROWS, in_features)  # [gate | up, inner / 16, 16, in]
    return halves.transpose(0, 1).reshape(2 * inner, in_features)


F32_NATIVE_MAX_ROWS = 384
"""Rows up to which float32 products use the native kernel: up to here it is at least level with torch's GEMM
on the decoder linears, beyond it torch's GEMM (over W^T rebuilt from the panels) is faster. Tuned with
`conveyor bench latency --input-len N` in float32 (prefill chunks of N rows)."""
_F32_PANEL_COLS = 32


def pack_f32_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] float32 -> [ceil(out / 32), in, 32]: panels[p, k, c] = W[32 p + c, k], zero past the
    last row (the layout of csrc/f32_linear.cpp)."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // _F32_PANEL_COLS)
    padded = weight.new_zeros(num_panels * _F32_PANEL_COLS, in_features)  # [panels * 32, in]
    padded[:out_features] = weight
    return padded.view(num_panels, _F32_PANEL_COLS, in_features).transpose(1, 2).contiguous()


def _native_f32(weight: torch.Tensor, kernels: NativeKernels | None) -> bool:
    """The native float32 kernel applies: given, built with AVX-512, and W float32 on the CPU."""
    return (
        kernels is not None
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape[1] > 0
        and kernels.f32_linear_vectorized()
    )


_TILE_ROWS, _TILE_K = 16, 32


def pack_bf16_tiles(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] bfloat16 (in a multiple of 32) -> tiles [ceil(out / 32) * 2, in / 32, 16, 32], the B operand
    of csrc/amx_product.cpp: tile t's piece kt holds rows 16 t..16 t + 15 x columns 32 kt..32 kt + 31 pair-
    interleaved (value [p, 2 r + h] = W[16 t + r, 32 kt + 2 p + h]); rows past the last are zeros. Written
    straight into the one new tensor (no padded copy of W on the way)."""
    out_features, in_features = weight.shape
    padded_rows = -(-out_features // (2 * _TILE_ROWS)) * 2 * _TILE_ROWS
    tiles = weight.new_empty(padded_rows // _TILE_ROWS, in_features // _TILE_K, _TILE_ROWS, _TILE_K)
    pairs = tiles.view(padded_rows // _TILE_ROWS, in_features // _TILE_K, _TILE_K // 2, _TILE_ROWS, 2)

    def place(row_tiles: slice, rows: torch.Tensor) -> None:  # rows [16 n, in] (any strides) -> tiles n
        pairs[row_tiles].copy_(
            rows.reshape(-1, _TILE_ROWS, in_features // _TILE_K, _TILE_K // 2, 2).permute(0, 2, 3, 1, 4)
        )  # [n, in / 32, pair, row, 2]

    whole = out_features // _TILE_ROWS  # full tiles
    place(slice(0, whole), weight[: whole * _TILE_ROWS])
    if padded_rows > whole * _TILE_ROWS:
        rest = weight.new_zeros(padded_rows - whole * _TILE_ROWS, in_features)  # [< 32, in]
        rest[: out_features - whole * _TILE_ROWS] = weight[whole * _TILE_ROWS :]
        place(slice(whole, None), rest)
    return tiles  # [out / 16, in / 32, 16, 32]


def unpack_bf16_tiles(tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """pack_bf16_tiles' inverse: -> W [out, in] (a copy)."""
    row_tiles, k_tiles = tiles.shape[:2]
    pairs = tiles.view(row_tiles, k_tiles, _TILE_K // 2, _TILE_ROWS, 2)  # [out / 16, in / 32, pair, row, 2]
    return pairs.permute(0, 3, 1, 2, 4).reshape(row_tiles * _TILE_ROWS, k_tiles * _TILE_K)[:out_features]


def _amx_bf16(weight: torch.Tensor, bias: torch.Tensor | None, kernels: NativeKernels | None) -> bool:
    """Our AMX kernel applies: the native kernels given and built with AMX on a CPU that grants it, W bfloat16 on
    the CPU with an input width a multiple of 32, and no bias (those keep oneDNN's pack, which adds it)."""
    return (
        kernels is not None
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and bias is None
        and weight.shape[1] > 0
        and weight.shape[1] % _TILE_K == 0
        and kernels.bf16_amx_available()
    )


_PACK_BATCH_HINT = 64
"""Rows oneDNN tunes the packed layout for; any row count works (checked bit-identical from 1 to 2048)."""


def _pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """W [out, in] bfloat16 on a CPU with native bf16 -> oneDNN-packed W; None where that does not apply."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not native_bf16_cpu():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)


@functools.cache
def native_bf16_cpu() -> bool:
    """This CPU computes bfloat16 natively (AVX-512 BF16 / AMX): oneDNN is built in, sees native bf16,
    and its private packing ops exist and agree with F.linear."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        w = torch.linspace(-1, 1, 24 * 16).reshape(24, 16).to(torch.bfloat16)  # [out, in]
        x = torch.linspace(-2, 2, 3 * 16).reshape(3, 16).to(torch.bfloat16)  # [rows, in]
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")
        return bool(torch.equal(got, F.linear(x, w)))
    except (AttributeError, RuntimeError):
        return False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim]; normalised in float32, scaled by weight, back in x's dtype (transformers' order:
    a low-precision x is rounded back before the weight multiplies it). One fused kernel in float32."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [tokens, 2 * intermediate] -> [tokens, intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [tokens, 2 * intermediate] -> gelu_tanh(gate) * up [tokens, intermediate] (GeGLU, Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
