"""GGUF-quantized weights kept compact: the file's own blocks, multiplied by native kernels.

A weight of one of the FORMATS below stays as the file stores it, [out rows][in / block blocks] of
bytes (csrc/gguf_linear.cpp reads the same layout ggml does): Q4_K is 4.5 bits per weight in memory, not
16. No float copy is kept; products dequantize in registers (few rows) or one tile at a time into a
thread's scratch for torch's GEMM (many rows). Other GGML types (Q2_K, Q3_K, IQ*, ...) are dequantized at
load, as before, and so is everything where the native kernels are missing or not vectorized (logged).

An HF folder can be quantized into the same formats at load (`quantization="q4_k"` etc., quantize()):
Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 with the `gguf` package's round-to-nearest quantizers (ggml's own);
Q4_K / Q5_K / Q6_K with the simple scheme of quantize_k() below.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from conveyor.errors import ConfigError

logger = logging.getLogger(__name__)


class QuantFormat(NamedTuple):
    type_id: int
    """GGML's id of the type (the kernels take it)."""
    block: int
    """Weights per block."""
    block_bytes: int


FORMATS = {
    "Q4_0": QuantFormat(2, 32, 18),
    "Q4_1": QuantFormat(3, 32, 20),
    "Q5_0": QuantFormat(6, 32, 22),
    "Q5_1": QuantFormat(7, 32, 24),
    "Q8_0": QuantFormat(8, 32, 34),
    "Q4_K": QuantFormat(12, 256, 144),
    "Q5_K": QuantFormat(13, 256, 176),
    "Q6_K": QuantFormat(14, 256, 210),
}
"""GGML weight types kept compact, by GGML's name."""
INT8_DOT_TYPES = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
"""Types whose few-rows products with bfloat16 activations quantize the activations to int8 and use integer dot
products (csrc/gguf_vnni.cpp), with the columns that share one activation scale (the K types: a super-block, as
ggml's Q8_K, so their sub-block scales apply in integers): every kept-compact type; float32 activations dequantize
exactly."""
QUANTIZATIONS = tuple(name.lower() for name in FORMATS)
"""`quantization=` values that quantize an HF folder at load into one of FORMATS."""


@dataclass(frozen=True)
class QuantizedWeight:
    """W [out_features, in_features] in GGML blocks; `dtype` is the compute dtype its products produce."""

    kind: str
    blocks: torch.Tensor  # [out_features, in_features / block * block_bytes] uint8
    in_features: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        fmt = FORMATS[self.kind]
        if (
            self.in_features % fmt.block
            or self.blocks.dim() != 2
            or self.blocks.dtype != torch.uint8
            or self.blocks.shape[1] != self.in_features // fmt.block * fmt.block_bytes
        ):
            raise ValueError(
                f"{self.kind} weight of {self.in_features} columns does not match blocks "
                f"{tuple(self.blocks.shape)} {self.blocks.dtype}"
            )

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.out_features, self.in_features])

    @property
    def type_id(self) -> int:
        return FORMATS[self.kind].type_id

    def with_dtype(self, dtype: torch.dtype) -> QuantizedWeight:
        return replace(self, dtype=dtype)

    def dequantize(self, kernels: object | None = None) -> torch.Tensor:
        """-> W [out, in] float32 by the `gguf` package's reference dequantization, or by the native kernels'
        when given (the same values exactly: test_gguf_quant.py checks it; vectorized and threaded, so loads are
        quick)."""
        if kernels is not None:
            return kernels.gguf_dequantize(self.blocks, self.type_id, self.in_features)  # type: ignore[attr-defined]
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks.numpy(), GGMLQuantizationType[self.kind])  # [out, in]
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def cat_rows(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight | RowStack:
    """Weights stacked by rows (fused QKV, gate/up): one tensor, one QuantizedWeight when every part has the
    same quantized type, else a RowStack of runs of one type (a Q4_K_M file keeps Q and K in Q4_K, V in Q6_K)."""
    runs: list[list[torch.Tensor | QuantizedWeight]] = []
    for part in parts:
        last = runs[-1][-1] if runs else None
        same = (isinstance(part, torch.Tensor) and isinstance(last, torch.Tensor)) or (
            isinstance(part, QuantizedWeight) and isinstance(last, QuantizedWeight) and part.kind == last.kind
        )
        if same:
            runs[-1].append(part)
        else:
            runs.append([part])
    merged = [
        torch.cat(run, dim=0)  # type: ignore[arg-type]  # a run is all tensors or all QuantizedWeight
        if isinstance(run[0], torch.Tensor)
        else replace(run[0], blocks=torch.cat([p.blocks for p in run], dim=0))  # type: ignore[union-attr]
        for run in runs
    ]
    return merged[0] if len(merged) == 1 else RowStack(tuple(merged))


@dataclass(frozen=True)
class RowStack:
    """Row blocks of one matrix in different types; the product is the concatenation of the parts'."""

    parts: tuple[torch.Tensor | QuantizedWeight, ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size([sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def with_dtype(self, dtype: torch.dtype) -> RowStack:
        return RowStack(
            tuple(p.to(dtype).contiguous() if isinstance(p, torch.Tensor) else p.with_dtype(dtype) for p in self.parts)
        )

    def dequantize(self, kernels: object | None = None) -> torch.Tensor:
        return torch.cat([p.float() if isinstance(p, torch.Tensor) else p.dequantize(kernels) for p in self.parts])


AnyWeight = torch.Tensor | QuantizedWeight | RowStack


def plain_tensor(weight: AnyWeight, name: str) -> torch.Tensor:
    """`weight` where only a plain tensor can be (norms, biases, a tensor-parallel shard); GGUF blocks are kept
    compact only for weight matrices, so anything else there is a bug, refused naming the weight."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight {name!r} is a {type(weight).__name__}; it must be a plain tensor")
    return weight


def dense(weight: AnyWeight, kernels: object | None = None) -> torch.Tensor:
    """The weight as a plain tensor in its compute dtype: GGUF blocks dequantized (by gguf's reference, or by the
    native kernels when given), a tensor as it is (for the code that needs rows or columns of it, or re-quantizes
    it)."""
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize(kernels).to(weight.dtype)


def cast_weight(weight: AnyWeight, dtype: torch.dtype) -> AnyWeight:
    """A float tensor in `dtype`; quantized weights stay as they are and compute in `dtype`."""
    if isinstance(weight, torch.Tensor):
        return weight.to(dtype).contiguous()
    return weight.with_dtype(dtype)


def kernels_keep_compact(kernels: object | None, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when compact weights can be multiplied here; else the reason they are dequantized at load."""
    if device.type != "cpu":
        return f"the GGUF kernels are CPU kernels and this model runs on {device}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the GGUF kernels compute in bfloat16 or float32, not {dtype}"
    if kernels is None:
        return "the native kernels are not in use (kernels='torch', or they could not be built)"
    if not kernels.gguf_linear_vectorized():  # type: ignore[attr-defined]
        return "this CPU lacks AVX2 + FMA (and AVX-512 VNNI), which the GGUF kernels are built for"
    return None


COMPACT_AUTO_BYTES = 1 << 30
"""gguf_weights='auto' keeps GGUF blocks compact when the dequantized weights would take more than this (a 1B model's
do, in bfloat16 or float32); smaller models are dequantized, for their batch throughput and exact products."""


def place_weights(
    weights: Mapping[str, AnyWeight], device: torch.device, kernels: object | None, mode: str
) -> dict[str, AnyWeight]:
    """The model's weights on its device; GGUF blocks kept compact or dequantized to their compute dtype as
    config.gguf_weights asks (see its doc), logged once."""
    quantized = [w for w in weights.values() if not isinstance(w, torch.Tensor)]
    if not quantized:
        return {name: w.to(device) for name, w in weights.items()}  # type: ignore[union-attr]
    dtype = quantized[0].dtype
    reason = kernels_keep_compact(kernels, device, dtype)
    dense_bytes = sum(w.shape[0] * w.shape[1] for w in quantized) * torch.empty((), dtype=dtype).element_size()
    if mode == "compact" and reason is not None:
        raise ConfigError(
            f"gguf_weights='compact' was requested, but {reason}; use gguf_weights='auto' or 'dequantize'"
        )
    small = dense_bytes <= COMPACT_AUTO_BYTES
    chosen = mode == "dequantize" or (mode == "auto" and reason is None and small)
    if mode == "auto" and reason is None and small:
        reason = (
            f"gguf_weights='auto' and they take only {dense_bytes / 2**20:.0f} MiB dequantized (compact "
            f"from {COMPACT_AUTO_BYTES >> 20} MiB; pass gguf_weights='compact' to keep them so)"
        )
    if mode == "dequantize":
        reason = "gguf_weights='dequantize'"
    if reason is None:
        logger.info(
            "GGUF-quantized weights kept compact (%d matrices); few-row products round the activations to int8 "
            "per block, as llama.cpp does",
            len(quantized),
        )
        return dict(weights)
    log = logger.info if chosen else logger.warning  # a choice is noted; a fallback (no kernels here) warned
    log(
        "GGUF-quantized weights are dequantized to %s at load (%.0f MiB): %s",
        str(dtype).removeprefix("torch."),
        dense_bytes / 2**20,
        reason,
    )
    native = kernels if kernels is not None and kernels.gguf_linear_vectorized() else None  # type: ignore[attr-defined]
    return {name: dense(w, native).to(device) for name, w in weights.items()}


def embedding_rows(
    embed: torch.Tensor | QuantizedWeight, token_ids: torch.Tensor, kernels: object | None
) -> torch.Tensor:
    """token_ids [n] -> their embedding rows [n, hidden] in the compute dtype."""
    if isinstance(embed, torch.Tensor):
        return torch.nn.functional.embedding(token_ids, embed)
    rows = embed.blocks.index_select(0, token_ids)  # [n, row bytes]
    return kernels.gguf_dequantize(rows, embed.type_id, embed.in_features).to(embed.dtype)  # type: ignore[union-attr]


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """W [out, in] float -> a QuantizedWeight of GGML type `kind`; raises ConfigError when in_features is not
    a whole number of the type's blocks."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    fmt = FORMATS[kind]
    out_features, in_features = weight.shape
    if in_features % fmt.block:
        raise ConfigError(
            f"quantization={kind.lower()!r} needs input widths that are multiples of {fmt.block}; "
            f"a weight [{out_features}, {in_features}] is not"
        )
    w = weight.float().numpy()
    blocks = quantize_k(w, kind) if kind.endswith("_K") else gguf_quantize(w, GGMLQuantizationType[kind])
    return QuantizedWeight(kind, torch.from_numpy(np.ascontiguousarray(blocks)), in_features, weight.dtype)


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def quantize_k(w: np.ndarray, kind: str) -> np.ndarray:
    """W [out, in] float32 -> [out, in / 256 * block_bytes] uint8 in Q4_K, Q5_K or Q6_K blocks.

    A simple scheme, not llama.cpp's search for the best scales: Q4_K / Q5_K take per 32-weight sub-block
    the range [min(0, lowest), highest] in 15 / 31 steps, and the sub-blocks' steps and minimums as 6-bit
    multiples of the block's largest; Q6_K takes per 16-weight sub-block max |w| / 32 as the step, as an
    8-bit multiple of the block's largest step."""
    rows = w.shape[0]
    blocks = w.reshape(rows, -1, 256)  # [out, blocks, 256]
    if kind == "Q6_K":
        return _quantize_q6_k(blocks)
    levels = 15 if kind == "Q4_K" else 31
    sub = blocks.reshape(rows, -1, 8, 32)  # [out, blocks, 8, 32]
    low = np.minimum(sub.min(-1), 0.0)  # [out, blocks, 8]
    step = (sub.max(-1) - low) / levels  # [out, blocks, 8]
    d = _f16(step.max(-1) / 63).astype(np.float32)  # [out, blocks]
    dmin = _f16(-low.min(-1) / 63).astype(np.float32)  # [out, blocks]
    sc = np.clip(np.round(np.divide(step, d[..., None], out=np.zeros_like(step), where=d[..., None] > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(-low, dmin[..., None], out=np.zeros_like(low), where=dmin[..., None] > 0)), 0, 63)
    scale = (d[..., None] * sc)[..., None]  # [out, blocks, 8, 1]
    offset = (dmin[..., None] * mn)[..., None]  # [out, blocks, 8, 1]
    q = np.clip(np.round(np.divide(sub + offset, scale, out=np.zeros_like(sub), where=scale > 0)), 0, levels)
    q = q.astype(np.uint8)  # [out, blocks, 8, 32]
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    packed = np.empty((rows, blocks.shape[1], 12), dtype=np.uint8)  # ggml's 12 bytes of 6-bit scales/mins
    packed[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mn[..., 4:8] & 0xF) << 4)
    pairs = q.reshape(rows, -1, 4, 2, 32)  # [out, blocks, 64-weight chunk, low/high nibble, 32]
    nibbles = (pairs[:, :, :, 0] & 0xF) | ((pairs[:, :, :, 1] & 0xF) << 4)  # [out, blocks, 4, 32]
    head = [_f16(d).view(np.uint8).reshape(rows, -1, 2), _f16(dmin).view(np.uint8).reshape(rows, -1, 2), packed]
    if kind == "Q5_K":
        bits = (q >> 4).reshape(rows, -1, 8, 32)  # [out, blocks, sub-block, 32]: sub-block j is bit j of qh
        qh = np.zeros((rows, blocks.shape[1], 32), dtype=np.uint8)
        for j in range(8):
            qh |= bits[:, :, j] << j
        head.append(qh)
    return np.concatenate([*head, nibbles.reshape(rows, -1, 128)], axis=-1).reshape(rows, -1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    rows, count = blocks.shape[:2]
    sub = blocks.reshape(rows, count, 16, 16)  # [out, blocks, 16, 16]
    step = np.abs(sub).max(-1) / 32  # [out, blocks, 16]
    d = _f16(step.max(-1) / 127).astype(np.float32)  # [out, blocks]
    sc = np.clip(np.round(np.divide(step, d[..., None], out=np.zeros_like(step), where=d[..., None] > 0)), 0, 127)
    scale = (d[..., None] * sc)[..., None]  # [out, blocks, 16, 1]
    q = np.clip(np.round(np.divide(sub, scale, out=np.zeros_like(sub), where=scale > 0)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(rows, count, 2, 4, 32)  # [out, blocks, half, quarter, 32]
    ql = np.concatenate(
        [(q[:, :, :, 0] & 0xF) | ((q[:, :, :, 2] & 0xF) << 4), (q[:, :, :, 1] & 0xF) | ((q[:, :, :, 3] & 0xF) << 4)],
        axis=-1,
    )  # [out, blocks, 2, 64]
    qh = (
        (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    )  # [out, blocks, 2, 32]
    return np.concatenate(
        [
            ql.reshape(rows, count, 128),
            qh.reshape(rows, count, 64),
            sc.astype(np.int8).view(np.uint8),
            _f16(d).view(np.uint8).reshape(rows, count, 2),
        ],
        axis=-1,
    ).reshape(rows, -1)
