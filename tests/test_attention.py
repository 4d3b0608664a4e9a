"""Paged attention against plain SDPA over contiguous K/V, on the same random data."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.attention import build_attention_batch, paged_attention
from conveyor.model.native import DecodeAttention, NativeKernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4


@pytest.fixture(params=["torch", "native"])
def decode_op(request: pytest.FixtureRequest) -> DecodeAttention | None:
    """Each test runs on the torch reference path and on the native decode kernel."""
    if request.param == "torch":
        return None
    kernels: NativeKernels = request.getfixturevalue("native_kernels")
    return kernels.decode_attention


def _reference(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, start: int) -> torch.Tensor:
    """q: [n, heads, d] at positions start..start+n-1; k_all/v_all: [start+n, kv_heads, d]."""
    n, ctx = q.shape[0], k_all.shape[0]
    group = HEADS // KV_HEADS
    k = k_all.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
    v = v_all.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
    mask = torch.arange(ctx)[None, :] <= torch.arange(start, start + n)[:, None]  # [n, ctx]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)  # [heads, n, d]
    return o.transpose(0, 1).reshape(n, HEADS * HEAD_DIM)


@pytest.mark.parametrize("seed", range(4))
def test_mixed_ragged_batch_matches_sdpa(seed: int, decode_op: DecodeAttention | None) -> None:
    """Decodes, fresh prefills and chunks behind a cached prefix in one flattened batch."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)  # garbage in unused slots must not matter
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (cached tokens already in the cache, new tokens this step)
    seqs = [(0, 1), (9, 1), (0, 7), (5, 6), (12, 1), (0, 13), (3, 1), (8, 4)]
    starts, lengths, tables, history = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        k_hist = torch.randn(total, KV_HEADS, HEAD_DIM)  # [total, kv_heads, d]
        v_hist = torch.randn(total, KV_HEADS, HEAD_DIM)
        for pos in range(cached):  # write the cached prefix directly
            k_cache[table[pos // BLOCK], pos % BLOCK] = k_hist[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = v_hist[pos]
        starts.append(cached)
        lengths.append(new)
        tables.append(table)
        history.append((k_hist, v_hist))
    n_tokens = sum(lengths)
    q = torch.randn(n_tokens, HEADS, HEAD_DIM)
    k_new = torch.cat([h[0][s:] for h, s in zip(history, starts)])  # [n_tokens, kv_heads, d]
    v_new = torch.cat([h[1][s:] for h, s in zip(history, starts)])
    batch = build_attention_batch(starts, lengths, tables, BLOCK)
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, HEAD_DIM ** -0.5, decode_op)  # [n_tokens, heads * d]

    row = 0
    for (k_hist, v_hist), start, n in zip(history, starts, lengths):
        expected = _reference(q[row:row + n], k_hist, v_hist, start)
        torch.testing.assert_close(out[row:row + n], expected, atol=1e-5, rtol=1e-5)
        row += n
    # the step's K/V landed in the right slots
    for (k_hist, _), start, n, table in zip(history, starts, lengths, tables):
        for pos in range(start, start + n):
            torch.testing.assert_close(k_cache[table[pos // BLOCK], pos % BLOCK], k_hist[pos])


def test_decode_only_batch_matches_sdpa(decode_op: DecodeAttention | None) -> None:
    torch.manual_seed(7)
    k_cache = torch.randn(16, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(16, BLOCK, KV_HEADS, HEAD_DIM)
    tables = [[3, 9, 1], [4], [15, 0]]
    contexts = [11, 2, 8]
    q = torch.randn(3, HEADS, HEAD_DIM)
    k_new = torch.randn(3, KV_HEADS, HEAD_DIM)
    v_new = torch.randn(3, KV_HEADS, HEAD_DIM)
    batch = build_attention_batch([c - 1 for c in contexts], [1, 1, 1], tables, BLOCK)
    assert not batch.prefills and len(batch.decode_groups) == 1
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, HEAD_DIM ** -0.5, decode_op)
    for i, (table, ctx) in enumerate(zip(tables, contexts)):
        k_all = torch.cat([k_cache[b] for b in table])[:ctx]  # [ctx, kv_heads, d] (new token already written)
        v_all = torch.cat([v_cache[b] for b in table])[:ctx]
        torch.testing.assert_close(k_all[-1], k_new[i])
        torch.testing.assert_close(out[i:i + 1], _reference(q[i:i + 1], k_all, v_all, ctx - 1), atol=1e-5, rtol=1e-5)


def test_many_decodes_in_length_groups_with_a_prefill_match_sdpa(decode_op: DecodeAttention | None) -> None:
    """More decodes than one group holds, unsorted lengths, plus a prefill in the middle of the batch."""
    torch.manual_seed(11)
    rng = random.Random(11)
    num_blocks = 400
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = [(rng.randrange(1, 60), 1) for _ in range(45)]
    seqs.insert(20, (0, 9))
    starts, lengths, tables = [], [], []
    for cached, new in seqs:
        starts.append(cached)
        lengths.append(new)
        tables.append([free.pop() for _ in range(-(-(cached + new) // BLOCK))])
    n_tokens = sum(lengths)
    q = torch.randn(n_tokens, HEADS, HEAD_DIM)
    k_new = torch.randn(n_tokens, KV_HEADS, HEAD_DIM)
    v_new = torch.randn(n_tokens, KV_HEADS, HEAD_DIM)
    batch = build_attention_batch(starts, lengths, tables, BLOCK)
    assert len(batch.decode_groups) >= 2
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, HEAD_DIM ** -0.5, decode_op)
    row = 0
    for start, n, table in zip(starts, lengths, tables):
        k_all = torch.cat([k_cache[b] for b in table])[:start + n]  # after the step's writes
        v_all = torch.cat([v_cache[b] for b in table])[:start + n]
        expected = _reference(q[row:row + n], k_all, v_all, start)
        torch.testing.assert_close(out[row:row + n], expected, atol=1e-5, rtol=1e-5)
        row += n
