"""The int8 KV cache (EngineConfig.kv_cache_dtype='int8'): half the bytes of a bfloat16 cache, so half the memory
traffic of decode attention, which reads every cached key and value once per step.

Each row (the head_dim values of one token and one KV head) is stored symmetrically: codes
q = round(x * (127 / amax)) in -127..127 and a float32 scale s = amax / 127, amax = max |x| over the row (both
quotients computed in float64 and rounded to float32; a row of zeros has codes 0 and scale 0). It reads back as
q * s in float32. This is lossy (relative error up to 1/254 of the row's largest value per element), like
OpenVINO's default u8 KV cache and vLLM's fp8 one; attention computes on the values read back.

One layer's K (or V) cache is int8 [num_blocks, kv_heads, block_size * (head_dim + 4)]: per block and KV head a
page of block_size x head_dim codes, then the block's block_size float32 scales. A V page holds its codes row by
row ([block_size][head_dim]), a K page dimension by dimension ([head_dim][block_size]: the block's tokens side by
side, so that the decode kernel's scores of 16 tokens are 16 lanes of one vector, with no sums across lanes). A
KV head's keys or values of one block are contiguous (1088 bytes for 16 tokens of head_dim 64: 17 cache lines),
read front to back; block-level operations (copy-on-write, gathers) index dim 0 as for the plain cache.

The torch functions here are the reference and the path without native kernels. csrc/kv_int8.h states the same
layout for the kernels: csrc/rotary_cache.cpp writes the same bytes, csrc/decode_attention_int8.cpp and
csrc/prefill_attention.cpp read them in place.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
"""One float32 scale per row."""


def page_bytes(block_size: int, head_dim: int) -> int:
    """Bytes of one (block, KV head) page."""
    return block_size * (head_dim + SCALE_BYTES)


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    return num_blocks, kv_heads, page_bytes(block_size, head_dim)


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int) -> int:
    """K and V of one token over all layers."""
    return 2 * num_layers * kv_heads * (head_dim + SCALE_BYTES)


def block_size_of(cache: torch.Tensor, head_dim: int) -> int:
    return cache.shape[2] // (head_dim + SCALE_BYTES)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> codes int8 [..., head_dim], scales float32 [...]."""
    values = x.float()  # [..., head_dim]
    amax = values.abs().amax(dim=-1).double()  # [...]
    inverse = torch.where(amax > 0, 127.0 / amax.clamp(min=1e-300), torch.zeros_like(amax)).float()  # [...]
    codes = torch.round(values * inverse.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)  # [..., head_dim]
    return codes, (amax / 127.0).float()


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes int8 [..., head_dim], scales float32 [...] -> codes * scale in float32, rounded to dtype [..., head_dim]:
    the one rule every reader of the cache follows (the native kernels too)."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


def read_back(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] -> the values an int8 cache gives back for it, in x's dtype (what a chunk attends to over
    its own fresh K/V, so that it sees what later steps read from the cache)."""
    return dequantize_rows(*quantize_rows(x), x.dtype)


def _views(cache: torch.Tensor, head_dim: int, keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [num_blocks, kv_heads, page] -> codes [num_blocks, kv_heads, block_size, head_dim] int8 and scales
    [num_blocks, kv_heads, block_size] float32, both views of it (keys: pages stored dimension by dimension)."""
    block_size = block_size_of(cache, head_dim)
    if keys:
        codes = cache[:, :, : block_size * head_dim].unflatten(2, (head_dim, block_size)).transpose(2, 3)
    else:
        codes = cache[:, :, : block_size * head_dim].unflatten(2, (block_size, head_dim))
    scales = cache[:, :, block_size * head_dim :].view(torch.float32)
    return codes, scales


def write_rows(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, keys: bool) -> None:
    """x [tokens, kv_heads, head_dim] -> the cache rows of slots slot_mapping [tokens] (keys: of a K cache)."""
    head_dim = x.shape[-1]
    codes, scales = quantize_rows(x)  # [tokens, kv_heads, head_dim], [tokens, kv_heads]
    code_view, scale_view = _views(cache, head_dim, keys)
    block_size = code_view.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # [tokens] each
    code_view.permute(0, 2, 1, 3)[blocks, offsets] = codes
    scale_view.permute(0, 2, 1)[blocks, offsets] = scales


def read_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, head_dim: int, dtype: torch.dtype, keys: bool
) -> torch.Tensor:
    """The rows of cache blocks `blocks` [k] read back -> [k, block_size, kv_heads, head_dim] in dtype (q * s in
    float32, then rounded to dtype; keys: of a K cache)."""
    codes, scales = _views(cache, head_dim, keys)
    values = dequantize_rows(codes.index_select(0, blocks), scales.index_select(0, blocks), dtype)  # [k, kvh, bs, d]
    return values.transpose(1, 2)
