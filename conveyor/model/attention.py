"""Paged attention over a flattened ragged batch (torch reference; runs on any device).

KV cache of one layer: [num_blocks, block_size, num_kv_heads, head_dim], for K and V; or, with
kv_cache_dtype='int8', int8 pages [num_blocks, num_kv_heads, block_size * (head_dim + 4)] (conveyor/model/kv_int8.py)
that every path here reads back to the compute dtype (read_blocks), the native kernels in place.
Token t of a request lives in slot  block_table[t // block_size] * block_size + t % block_size:

    block_table = [7, 2]  block_size = 4
    positions   0 1 2 3 | 4 5
    slots      28..31   | 8 9

Every layer first writes this step's K/V through the slot mapping, then attends:
  - decodes (one query token each) are batched. With the native CPU kernel (model/native.py)
    they attend in place through their block tables, all in one call. Otherwise (torch
    reference, any device) they go in groups of similar context length (less padding): a
    group's blocks are gathered into [group, max_context, kv_heads, head_dim] and masked by
    context length;
  - prefill chunks: with the native CPU kernel (bfloat16 on AMX; full or sliding-window attention, no soft cap)
    all chunks of the step with up to NATIVE_PREFILL_MAX_CONTEXT tokens of context attend in one call, reading
    their K/V through their block tables. Longer ones, and all elsewhere, attend one by
    one: a chunk with no cached context uses its own K/V with a causal mask; a chunk behind cached tokens
    gathers its blocks and uses an offset-causal mask. Each request attends only over its own blocks.

Sliding-window layers (window W) mask keys more than W - 1 positions behind the query too: the query at
position q attends to keys q - W + 1 .. q. Blocks wholly behind every query's window may have been freed
(core/kv_cache.py): their table entries then point at another block, whose keys the window masks out.
The native decode kernel has no window; windowed layers take the torch path (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from conveyor.core.kv_cache import FREED_BLOCK
from conveyor.model import kv_int8
from conveyor.model.native import DecodeAttention, PrefillAttention

logger = logging.getLogger(__name__)


@dataclass
class PrefillChunk:
    token_start: int
    """Index of the chunk's first token in the flattened batch."""
    num_tokens: int
    context_len: int
    """Tokens of the request whose K/V exist after this step (cached + this chunk)."""
    block_table: torch.Tensor | None
    """[blocks covering context_len] int64; None when the chunk has no cached context."""
    mask: torch.Tensor | None = None
    """[num_tokens, context_len] additive mask in the query dtype (0 = attend, -inf = not): built
    on the device by the first layer that needs it (not on the host, whose thread must stay out
    of torch's thread pool)."""
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    """The same with a sliding window, by window size."""
    native: bool = False
    """Short enough for the native prefill kernel (context_len <= NATIVE_PREFILL_MAX_CONTEXT), where it applies."""


NATIVE_PREFILL_MAX_CONTEXT = 4096
"""Context length up to which a prefill chunk takes the native kernel (csrc/prefill_attention.cpp) where it applies;
longer ones take torch's fused kernel. The native kernel was checked to beat torch's SDPA up to this length (one
prompt from scratch, bfloat16, 64- and 128-wide heads, grouped and not); beyond it, torch's kernel is kept.
Tuned with `conveyor bench latency --input-len N` (time to first token)."""


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [group] int64 rows of the flattened batch
    block_tables: torch.Tensor  # [group, max_blocks] int64
    context_lens: torch.Tensor  # [group] int64
    in_order: bool
    """rows are exactly 0..group-1 (then no gather / scatter of rows is needed)."""
    mask: torch.Tensor | None = None
    """[group, 1, 1, max_blocks * block_size] additive mask in the query dtype, built on the device
    by the first layer."""
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    """The same with a sliding window, by window size."""


DECODE_GROUP_SIZE = 32
"""Decodes sorted by context length are attended in groups of this many: each group is padded
only to its own longest context (fewer bytes gathered than one group padded to the longest)."""


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    prefill_spans: torch.Tensor | None = None
    """[native chunks, 3] int64: each native prefill chunk's first row, rows and context length (None if none)."""
    prefill_tables: torch.Tensor | None = None
    """[native chunks, max_blocks] int64: each native prefill chunk's block table (covering its context),
    zero-padded."""


def build_attention_batch(
    starts: list[int],
    lengths: list[int],
    tables: list[list[int]],
    block_size: int,
    to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    decode_group_size: int = DECODE_GROUP_SIZE,
    lookahead: int = 0,
) -> AttentionBatch:
    """Metadata shared by all layers of one step, from plain per-sequence lists.

    Tensors are built on the host, then moved by `to_device` (a pinned, non-blocking copy on CUDA).
    The native decode kernel pads nothing, so it takes all decodes as one group
    (decode_group_size >= their number; they then stay in batch order). `lookahead`: the decodes' block tables
    also cover that many tokens past this step (the later steps of a multi-step plan read them).
    """
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    native_spans: list[list[int]] = []  # the native kernel's chunks: [first row, rows, context length]
    native_tables: list[list[int]] = []
    row = 0
    for start, n, table in zip(starts, lengths, tables):
        if table and table[0] == FREED_BLOCK:  # blocks a sliding window passed: any block will do, masked out
            live = next(b for b in table if b != FREED_BLOCK)
            table = [live if b == FREED_BLOCK else b for b in table]
        for pos in range(start, start + n):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        context = start + n
        used = table[: -(-(context + (lookahead if n == 1 else 0)) // block_size)]
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(used)
            decode_lens.append(context)
        else:
            native = context <= NATIVE_PREFILL_MAX_CONTEXT
            if native:
                native_spans.append([row, n, context])
                native_tables.append(used)
            block_table = None if start == 0 else to_device(torch.tensor(used, dtype=torch.int64))
            prefills.append(PrefillChunk(row, n, context, block_table, native=native))
        row += n
    groups = []
    order = sorted(range(len(decode_rows)), key=lambda i: decode_lens[i])
    single = len(order) <= decode_group_size
    for start in range(0, len(order), decode_group_size):
        members = (
            sorted(order[start : start + decode_group_size]) if single else order[start : start + decode_group_size]
        )
        rows = [decode_rows[i] for i in members]
        width = max(len(decode_tables[i]) for i in members)
        padded = [decode_tables[i] + [0] * (width - len(decode_tables[i])) for i in members]
        groups.append(
            DecodeGroup(
                rows=to_device(torch.tensor(rows, dtype=torch.int64)),
                block_tables=to_device(torch.tensor(padded, dtype=torch.int64)),
                context_lens=to_device(torch.tensor([decode_lens[i] for i in members], dtype=torch.int64)),
                in_order=rows == list(range(len(rows))),
            )
        )
    spans: torch.Tensor | None = None
    span_tables: torch.Tensor | None = None
    if native_spans:
        width = max(len(t) for t in native_tables)
        spans = to_device(torch.tensor(native_spans, dtype=torch.int64))
        span_tables = to_device(torch.tensor([t + [0] * (width - len(t)) for t in native_tables], dtype=torch.int64))
    return AttentionBatch(
        slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64)),
        decode_groups=groups,
        prefills=prefills,
        prefill_spans=spans,
        prefill_tables=span_tables,
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] -> cache slots (quantized where the cache is int8)."""
    if k_cache.dtype == torch.int8:
        kv_int8.write_rows(k, k_cache, slot_mapping, keys=True)
        kv_int8.write_rows(v, v_cache, slot_mapping, keys=False)
        return
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def read_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, head_dim: int, dtype: torch.dtype, keys: bool
) -> torch.Tensor:
    """The K (keys) or V rows of cache blocks `blocks` [k] -> [k, block_size, kv_heads, head_dim] in dtype, from a
    plain cache or an int8 one (read back: conveyor/model/kv_int8.py)."""
    if cache.dtype == torch.int8:
        return kv_int8.read_blocks(cache, blocks, head_dim, dtype, keys)
    return gather_blocks(cache, blocks).view(blocks.shape[0], cache.shape[1], cache.shape[2], head_dim)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, kv_heads, d], blocks [k] -> [k, block_size * kv_heads * d].

    index_select over a 2-D view copies whole contiguous rows, where advanced indexing (cache[blocks]) goes
    through the generic element-wise gather path, which is slower on CPU."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


def additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = attend) -> 0 / -inf in dtype. SDPA adds a float mask as is; a bool one it
    converts on every call (a `where` per layer)."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    decode_op: DecodeAttention | None = None,
    kv_written: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    prefill_op: PrefillAttention | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] (this step's).

    Returns [num_tokens, heads * head_dim]. Writes k, v into the caches first (unless the caller
    already has: kv_written). Decodes go to `decode_op` (the native kernel) when given, else
    through the torch gather + SDPA path; prefill chunks to `prefill_op` (the native kernel) where it applies
    (bfloat16, head_dim a multiple of 32, no soft cap, context up to NATIVE_PREFILL_MAX_CONTEXT), else through
    SDPA chunk by chunk. `window`: this layer's sliding window, None for full attention.
    `softcap`: scores become softcap * tanh(scores / softcap) (Gemma 2), computed without SDPA.
    """
    if (window is not None or softcap is not None) and decode_op is not None:
        _log_once(_WINDOW_FALLBACK)
        decode_op = None
    num_tokens, heads, head_dim = q.shape
    if not kv_written:
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    out = q.new_empty(num_tokens, heads, head_dim)  # [num_tokens, heads, head_dim]

    for group in batch.decode_groups:
        n = group.block_tables.shape[0]
        q_dec = q[:n] if group.in_order else q.index_select(0, group.rows)  # [n, heads, head_dim]
        if decode_op is not None:
            o = decode_op(q_dec, k_cache, v_cache, group.block_tables, group.context_lens, scale)  # [n, heads, d]
        else:
            o = _gathered_decode(q_dec, k_cache, v_cache, group, scale, window, softcap)  # [n, heads, head_dim]
        if group.in_order and n == num_tokens:
            out = o
        else:
            out.index_copy_(0, group.rows, o)

    if softcap is not None and batch.prefills:
        _log_once(_SOFTCAP_PREFILL)
    native = prefill_op is not None and softcap is None and q.dtype == torch.bfloat16 and head_dim % 32 == 0
    if k_cache.dtype == torch.int8 and any(c.block_table is None and not (native and c.native) for c in batch.prefills):
        k, v = kv_int8.read_back(k), kv_int8.read_back(v)  # chunks attend to their own K/V as the cache holds them
    if native and batch.prefill_spans is not None:
        assert prefill_op is not None and batch.prefill_tables is not None
        q_rows = q if q.stride(2) == 1 and q.stride(1) == head_dim else q.contiguous()  # [num_tokens, heads, d]
        prefill_op(q_rows, k_cache, v_cache, batch.prefill_tables, batch.prefill_spans, scale, window or 0, out)
    for chunk in batch.prefills:
        if native and chunk.native:
            continue
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        # A batch axis of 1 on every SDPA operand: torch's fused CPU kernel takes only 4-D inputs (see `attend`)
        q_c = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, head_dim]
        if chunk.block_table is None and (window is None or chunk.num_tokens <= window):
            k_c = k[rows].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, chunk, head_dim]
            v_c = v[rows].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, chunk, head_dim]
            o = attend(q_c, k_c, v_c, None, scale, softcap, is_causal=True)  # [1, heads, chunk, head_dim]
        elif chunk.block_table is None:  # a window shorter than the chunk: its own K/V, banded causal mask
            assert window is not None
            mask = chunk.window_masks.get(window)
            if mask is None:
                mask = chunk.window_masks[window] = _prefill_mask(chunk.num_tokens, chunk.num_tokens, window, q)
            k_c = k[rows].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, chunk, head_dim]
            v_c = v[rows].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, chunk, head_dim]
            o = attend(q_c, k_c, v_c, mask, scale, softcap)  # [1, heads, chunk, head_dim]
        else:
            ctx = chunk.context_len
            if window is None:
                if chunk.mask is None:
                    chunk.mask = _prefill_mask(chunk.num_tokens, ctx, None, q)
                mask = chunk.mask
            else:
                mask = chunk.window_masks.get(window)
                if mask is None:
                    mask = chunk.window_masks[window] = _prefill_mask(chunk.num_tokens, ctx, window, q)
            k_c = _gathered_context(k_cache, chunk.block_table, ctx, head_dim, q.dtype, keys=True)  # [1, kvh, ctx, d]
            v_c = _gathered_context(v_cache, chunk.block_table, ctx, head_dim, q.dtype, keys=False)  # same shape
            o = attend(q_c, k_c, v_c, mask, scale, softcap)  # [1, heads, chunk, head_dim]
        out[rows] = o[0].transpose(0, 1)  # [chunk, heads, head_dim]
    return out.reshape(num_tokens, heads * head_dim)


def _gathered_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, head_dim: int, dtype: torch.dtype, keys: bool
) -> torch.Tensor:
    """A prefill chunk's cached keys or values: cache [num_blocks, block_size, kv_heads, d] (or int8 pages),
    block_table [k] -> [1, kv_heads, context_len, d] in dtype (a view of one gathered copy)."""
    blocks = read_blocks(cache, block_table, head_dim, dtype, keys=keys)  # [k, block_size, kv_heads, d]
    gathered = blocks.flatten(0, 1).unsqueeze(0)  # [1, k * block_size, kv_heads, d]
    return gathered[:, :context_len].transpose(1, 2)


def _prefill_mask(num_queries: int, context_len: int, window: int | None, q: torch.Tensor) -> torch.Tensor:
    """[num_queries, context_len] additive mask for the chunk's last num_queries positions: causal, and within
    the window when given."""
    q_pos = torch.arange(context_len - num_queries, context_len, device=q.device)[:, None]  # [chunk, 1]
    k_pos = torch.arange(context_len, device=q.device)[None, :]  # [1, context_len]
    valid = k_pos <= q_pos
    if window is not None:
        valid &= k_pos > q_pos - window
    return additive_mask(valid, q.dtype)


_WINDOW_FALLBACK = (
    "sliding-window and soft-capped layers decode through the torch gather + attention path (the "
    "native decode kernel has neither); other layers keep the native kernel"
)
_SOFTCAP_PREFILL = (
    "soft-capped layers attend through explicit scores (tanh cap, float32 softmax) instead of torch's "
    "fused attention kernel, which has no soft cap; sliding windows keep the fused kernel with a mask"
)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    """Say once per process which slower path a model's layers take."""
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def _gathered_decode(
    q_dec: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The torch reference for a decode group: gather its blocks, pad, mask, SDPA. -> [n, heads, head_dim]."""
    n, heads, head_dim = q_dec.shape
    flat = group.block_tables.view(-1)  # [n * max_blocks]
    keys = read_blocks(k_cache, flat, head_dim, q_dec.dtype, keys=True)  # [n * max_blocks, block_size, kvh, d]
    values = read_blocks(v_cache, flat, head_dim, q_dec.dtype, keys=False)  # [n * max_blocks, block_size, kvh, d]
    kv_heads = keys.shape[2]
    mask = group.mask if window is None else group.window_masks.get(window)
    if mask is None:
        k_pos = torch.arange(flat.shape[0] // n * keys.shape[1], device=q_dec.device)  # [max_context]
        valid = k_pos[None, :] < group.context_lens[:, None]  # [n, max_context]
        if window is not None:  # the query sits at context_len - 1
            valid &= k_pos[None, :] >= group.context_lens[:, None] - window
        mask = additive_mask(valid, q_dec.dtype)[:, None, None, :]  # [n, 1, 1, max_context]
        if window is None:
            group.mask = mask
        else:
            group.window_masks[window] = mask
    keys = keys.reshape(n, -1, kv_heads, head_dim).transpose(1, 2)  # [n, kv_heads, ctx, d]
    values = values.reshape(n, -1, kv_heads, head_dim).transpose(1, 2)  # [n, kv_heads, ctx, d]
    # Fold the query heads of one KV group into the query-length axis: [n, kv_heads, group, head_dim]
    q_grouped = q_dec.reshape(n, kv_heads, heads // kv_heads, head_dim)
    o = attend(q_grouped, keys, values, mask, scale, softcap)
    return o.reshape(n, heads, head_dim)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA over q [batch, heads, q_len, d] and k, v [batch, kv_heads, k_len, d] (grouped-query when fewer kv heads);
    with a softcap, the scores are capped explicitly (SDPA has no such option), softmax in float32.

    Always 4-D: on CPU, torch sends 3-D inputs to its "math" fallback, which copies q, k, v to float32 and
    materialises every score, several times slower, and more so as chunks grow. Its fused
    "flash" kernel works one (batch, head, query block) at a time with splits that depend only on the sequence
    lengths, so a head's output has the same bits whatever the number of heads or threads in the call
    (tensor-parallel ranks each hold some of the heads; tests/model/test_attention.py checks this)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=k.shape[-3] != q.shape[-3]
        )
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)  # [..., heads, k_len, d]
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)  # [..., heads, k_len, d]
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap  # [..., heads, q_len, k_len]
    if is_causal:
        q_len, k_len = scores.shape[-2], scores.shape[-1]
        q_pos = torch.arange(k_len - q_len, k_len, device=q.device)[:, None]
        mask = additive_mask(torch.arange(k_len, device=q.device)[None, :] <= q_pos, scores.dtype)
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
