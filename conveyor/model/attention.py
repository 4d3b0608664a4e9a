"""Paged attention over a flattened ragged batch (torch reference; runs on any device).

KV cache of one layer: [num_blocks, block_size, num_kv_heads, head_dim], for K and V.
Token t of a request lives in slot  block_table[t // block_size] * block_size + t % block_size:

    block_table = [7, 2]  block_size = 4
    positions   0 1 2 3 | 4 5
    slots      28..31   | 8 9

Every layer first writes this step's K/V through the slot mapping, then attends:
  - decodes (one query token each) are batched: their blocks are gathered into
    [num_decodes, max_context, kv_heads, head_dim] and masked by context length;
  - prefill chunks attend one by one: a chunk with no cached context uses its own K/V
    with a causal mask; a chunk behind cached tokens gathers its blocks and uses an
    offset-causal mask. Each request attends only over its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int
    """Index of the chunk's first token in the flattened batch."""
    num_tokens: int
    context_len: int
    """Tokens of the request whose K/V exist after this step (cached + this chunk)."""
    block_table: torch.Tensor | None
    """[blocks covering context_len] int64; None when the chunk has no cached context."""
    mask: torch.Tensor | None
    """[num_tokens, context_len] bool, True = attend; None when plain causal applies."""


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode_token_index: torch.Tensor | None  # [num_decodes] int64 rows of the flattened batch
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]
    all_decodes: bool
    """True when every token is a decode (then decode rows are 0..n-1 in order)."""


def build_attention_batch(starts: list[int], lengths: list[int], tables: list[list[int]], block_size: int,
                          to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> AttentionBatch:
    """Metadata shared by all layers of one step, from plain per-sequence lists.

    Tensors are built on the host, then moved by `to_device` (a pinned, non-blocking copy on CUDA).
    """
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    row = 0
    for start, n, table in zip(starts, lengths, tables):
        for pos in range(start, start + n):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        context = start + n
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(table[:-(-context // block_size)])
            decode_lens.append(context)
        elif start == 0:
            prefills.append(PrefillChunk(row, n, context, None, None))
        else:
            used = table[:-(-context // block_size)]
            q_pos = torch.arange(start, context)  # [n]
            k_pos = torch.arange(context)  # [context]
            mask = k_pos[None, :] <= q_pos[:, None]  # [n, context]
            prefills.append(PrefillChunk(row, n, context, to_device(torch.tensor(used, dtype=torch.int64)),
                                         to_device(mask)))
        row += n
    decode_index = decode_tables_t = decode_mask = None
    if decode_rows:
        width = max(len(t) for t in decode_tables)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        decode_index = to_device(torch.tensor(decode_rows, dtype=torch.int64))
        decode_tables_t = to_device(torch.tensor(padded, dtype=torch.int64))
        lens = torch.tensor(decode_lens, dtype=torch.int64)  # [num_decodes]
        k_pos = torch.arange(width * block_size)  # [max_context]
        decode_mask = to_device((k_pos[None, :] < lens[:, None])[:, None, None, :])  # [num_decodes, 1, 1, max_ctx]
    return AttentionBatch(
        slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64)),
        decode_token_index=decode_index, decode_block_tables=decode_tables_t, decode_mask=decode_mask,
        prefills=prefills, all_decodes=not prefills)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] -> cache slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] (this step's).

    Returns [num_tokens, heads * head_dim]. Writes k, v into the caches first.
    """
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    out = q.new_empty(num_tokens, heads, head_dim)  # [num_tokens, heads, head_dim]

    if batch.decode_token_index is not None:
        tables = batch.decode_block_tables  # [num_decodes, max_blocks]
        n = tables.shape[0]
        keys = k_cache[tables].view(n, -1, kv_heads, head_dim).transpose(1, 2)  # [n, kv_heads, ctx, head_dim]
        values = v_cache[tables].view(n, -1, kv_heads, head_dim).transpose(1, 2)  # [n, kv_heads, ctx, head_dim]
        q_dec = q if batch.all_decodes else q[batch.decode_token_index]  # [n, heads, head_dim]
        # Fold the query heads of one KV group into the query-length axis: [n, kv_heads, group, head_dim]
        q_dec = q_dec.view(n, kv_heads, heads // kv_heads, head_dim)
        o = F.scaled_dot_product_attention(q_dec, keys, values, attn_mask=batch.decode_mask, scale=scale)
        o = o.reshape(n, heads, head_dim)  # [n, heads, head_dim]
        if batch.all_decodes:
            out = o
        else:
            out[batch.decode_token_index] = o

    for chunk in batch.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        q_c = q[rows].transpose(0, 1)  # [heads, chunk, head_dim]
        if chunk.block_table is None:
            k_c = k[rows].transpose(0, 1)  # [kv_heads, chunk, head_dim]
            v_c = v[rows].transpose(0, 1)  # [kv_heads, chunk, head_dim]
            o = F.scaled_dot_product_attention(q_c, k_c, v_c, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ctx = chunk.context_len
            k_c = k_cache[chunk.block_table].view(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)  # [kv_heads, ctx, d]
            v_c = v_cache[chunk.block_table].view(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)  # [kv_heads, ctx, d]
            o = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[rows] = o.transpose(0, 1)  # [chunk, heads, head_dim]
    return out.reshape(num_tokens, heads * head_dim)
