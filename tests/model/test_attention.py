"""Paged attention against plain SDPA over contiguous K/V, on the same random data."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.attention import build_attention_batch, paged_attention
from conveyor.model.native import DecodeAttention, NativeKernels, PrefillAttention

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
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, HEAD_DIM**-0.5, decode_op)  # [n_tokens, heads * d]

    row = 0
    for (k_hist, v_hist), start, n in zip(history, starts, lengths):
        expected = _reference(q[row : row + n], k_hist, v_hist, start)
        torch.testing.assert_close(out[row : row + n], expected, atol=1e-5, rtol=1e-5)
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
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, HEAD_DIM**-0.5, decode_op)
    for i, (table, ctx) in enumerate(zip(tables, contexts)):
        k_all = torch.cat([k_cache[b] for b in table])[:ctx]  # [ctx, kv_heads, d] (new token already written)
        v_all = torch.cat([v_cache[b] for b in table])[:ctx]
        torch.testing.assert_close(k_all[-1], k_new[i])
        torch.testing.assert_close(
            out[i : i + 1], _reference(q[i : i + 1], k_all, v_all, ctx - 1), atol=1e-5, rtol=1e-5
        )


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
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, HEAD_DIM**-0.5, decode_op)
    row = 0
    for start, n, table in zip(starts, lengths, tables):
        k_all = torch.cat([k_cache[b] for b in table])[: start + n]  # after the step's writes
        v_all = torch.cat([v_cache[b] for b in table])[: start + n]
        expected = _reference(q[row : row + n], k_all, v_all, start)
        torch.testing.assert_close(out[row : row + n], expected, atol=1e-5, rtol=1e-5)
        row += n


@dataclass
class _Bf16Step:
    """A bfloat16 step with a fresh prompt (causal), a chunk behind a cached prefix (masked) and one decode, in a
    paged cache with shuffled blocks."""

    q: torch.Tensor  # [tokens, heads, d]
    k: torch.Tensor  # [tokens, kv_heads, d]
    v: torch.Tensor  # [tokens, kv_heads, d]
    k_cache: torch.Tensor  # [blocks, BLOCK, kv_heads, d]
    v_cache: torch.Tensor  # [blocks, BLOCK, kv_heads, d]
    seqs: list[tuple[int, int]]  # (cached, new) per sequence
    tables: list[list[int]]

    @staticmethod
    def random(heads: int, kv_heads: int, head_dim: int, seed: int) -> _Bf16Step:
        torch.manual_seed(seed)
        rng = random.Random(seed)
        num_blocks = 48
        free = list(range(num_blocks))
        rng.shuffle(free)
        seqs = [(0, 37), (21, 18), (30, 1)]
        n_tokens = sum(n for _, n in seqs)
        return _Bf16Step(
            q=torch.randn(n_tokens, heads, head_dim).bfloat16(),
            k=torch.randn(n_tokens, kv_heads, head_dim).bfloat16(),
            v=torch.randn(n_tokens, kv_heads, head_dim).bfloat16(),
            k_cache=torch.randn(num_blocks, BLOCK, kv_heads, head_dim).bfloat16(),
            v_cache=torch.randn(num_blocks, BLOCK, kv_heads, head_dim).bfloat16(),
            seqs=seqs,
            tables=[[free.pop() for _ in range(-(-(c + n) // BLOCK))] for c, n in seqs],
        )

    def attend(
        self, heads: slice, kv_heads: slice, window: int | None = None, prefill_op: PrefillAttention | None = None
    ) -> torch.Tensor:
        """paged_attention over the given heads only, as one tensor-parallel rank holds them -> [tokens, n, d]."""
        batch = build_attention_batch([c for c, _ in self.seqs], [n for _, n in self.seqs], self.tables, BLOCK)
        q = self.q[:, heads].contiguous()  # [tokens, n, d]
        out = paged_attention(
            q,
            self.k[:, kv_heads].contiguous(),
            self.v[:, kv_heads].contiguous(),
            self.k_cache[:, :, kv_heads].clone(),
            self.v_cache[:, :, kv_heads].clone(),
            batch,
            q.shape[-1] ** -0.5,
            window=window,
            prefill_op=prefill_op,
        )  # [tokens, n * d]
        return out.view(q.shape)


@pytest.mark.parametrize("window", [None, 9])
def test_bf16_prefill_takes_the_fused_kernel_and_matches_float32_math(window: int | None) -> None:
    """Every SDPA call of a bfloat16 step (fresh prompt, chunk behind a cache, decode; with and without a sliding
    window) is allowed only torch's fused flash kernel, so one that fell back to the slow float32 "math" path
    (3-D inputs do) raises. The result must match float32 math attention over the same bfloat16 values."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, head_dim = 8, 2, 32
    step = _Bf16Step.random(heads, kv_heads, head_dim, seed=3)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = step.attend(slice(None), slice(None), window)  # [tokens, heads, d]
    row = 0
    for (cached, new), table in zip(step.seqs, step.tables):
        ctx = cached + new
        k_all = torch.cat([step.k_cache[b] for b in table])[:ctx].clone()  # [ctx, kv_heads, d]: cached prefix ...
        v_all = torch.cat([step.v_cache[b] for b in table])[:ctx].clone()
        k_all[cached:], v_all[cached:] = step.k[row : row + new], step.v[row : row + new]  # ... and this step's
        q_pos = torch.arange(cached, ctx)[:, None]  # [new, 1]
        k_pos = torch.arange(ctx)[None, :]  # [1, ctx]
        valid = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window is not None else True)  # [new, ctx]
        with sdpa_kernel([SDPBackend.MATH]):
            expected = F.scaled_dot_product_attention(
                step.q[row : row + new].float().transpose(0, 1),  # [heads, new, d]
                k_all.float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1),  # [heads, ctx, d]
                v_all.float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1),
                attn_mask=valid,
                scale=head_dim**-0.5,
            ).transpose(0, 1)  # [new, heads, d]
        # bfloat16 probabilities and output: a few units of bfloat16's 2^-8 relative step
        torch.testing.assert_close(out[row : row + new].float(), expected, atol=2e-2, rtol=2e-2)
        row += new


@pytest.mark.parametrize("prefill", ["torch", "native"])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_gives_a_head_the_same_bits_whatever_other_heads_share_the_call(
    threads: int, prefill: str, request: pytest.FixtureRequest
) -> None:
    """Tensor parallelism gives each rank a slice of the query and KV heads: a head's attention output may not
    depend on how many heads are in the call (nor on the thread count each rank runs with). Bit for bit, bfloat16,
    over prefills with and without a cached prefix and a decode; torch's fused kernel and the native (AMX) one."""
    heads, kv_heads = 8, 4
    step = _Bf16Step.random(heads, kv_heads, 64, seed=5)
    prefill_op = None
    if prefill == "native":
        kernels: NativeKernels = request.getfixturevalue("native_kernels")
        if not kernels.prefill_attention_available():
            pytest.skip("the native prefill attention needs AMX-BF16")
        prefill_op = kernels.prefill_attention
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = step.attend(slice(None), slice(None), prefill_op=prefill_op)  # [tokens, heads, d]
        torch.set_num_threads(threads)
        for rank in range(2):  # two ranks: half the query heads and their KV heads each
            got = step.attend(slice(rank * 4, rank * 4 + 4), slice(rank * 2, rank * 2 + 2), prefill_op=prefill_op)
            assert torch.equal(got, full[:, rank * 4 : rank * 4 + 4]), f"rank {rank} of 2 on {threads} thread(s)"
        for group in range(kv_heads):  # one KV head and its query heads per call
            got = step.attend(slice(group * 2, group * 2 + 2), slice(group, group + 1), prefill_op=prefill_op)
            assert torch.equal(got, full[:, group * 2 : group * 2 + 2]), f"KV group {group} on {threads} thread(s)"
    finally:
        torch.set_num_threads(before)
