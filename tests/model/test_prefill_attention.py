"""The native prefill attention (csrc/prefill_attention.cpp, AMX): every prompt chunk of a step in one call,
against float64 attention over the same bfloat16 values, and no less exact than torch's own fused kernel."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.attention import NATIVE_PREFILL_MAX_CONTEXT, build_attention_batch, paged_attention


@pytest.fixture(scope="module")
def kernels(native_kernels: Any) -> Any:
    if not native_kernels.prefill_attention_available():
        pytest.skip("the native prefill attention needs AMX-BF16 (this CPU or kernel does not grant it)")
    return native_kernels


def _random_step(
    heads: int, kv_heads: int, head_dim: int, block_size: int, seqs: list[tuple[int, int]], seed: int, sharpness: float
) -> dict[str, Any]:
    """A paged bfloat16 cache holding every sequence's context (blocks shuffled, garbage elsewhere), q for the new
    tokens of each (cached, new) sequence; q scaled by `sharpness` so that softmax is peaked, not flat."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    tokens = sum(n for _, n in seqs) + 2  # two rows no chunk owns (as decode rows would be)
    return dict(
        q=(torch.randn(tokens, heads, head_dim) * sharpness).bfloat16(),
        k_cache=torch.randn(num_blocks, block_size, kv_heads, head_dim).bfloat16(),
        v_cache=torch.randn(num_blocks, block_size, kv_heads, head_dim).bfloat16(),
        tables=tables,
        seqs=seqs,
        block_size=block_size,
    )


def _reference(
    step: dict[str, Any], row: int, cached: int, new: int, table: list[int], dtype: torch.dtype, window: int = 0
) -> torch.Tensor:
    """Causal attention of one chunk over its context (within a sliding window if given) in `dtype` (float64: exact;
    bfloat16: torch's SDPA)."""
    heads, kv_heads = step["q"].shape[1], step["k_cache"].shape[2]
    ctx = cached + new
    k = torch.cat([step["k_cache"][b] for b in table])[:ctx]  # [ctx, kv_heads, d]
    v = torch.cat([step["v_cache"][b] for b in table])[:ctx]
    q = step["q"][row : row + new]  # [new, heads, d]
    k_pos, q_pos = torch.arange(ctx)[None, :], torch.arange(cached, ctx)[:, None]
    valid = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)  # [new, ctx]
    if dtype == torch.float64:
        k = k.double().repeat_interleave(heads // kv_heads, dim=1)
        v = v.double().repeat_interleave(heads // kv_heads, dim=1)
        q = q.double()
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=valid,
        enable_gqa=k.shape[1] != heads,
    )  # [1, heads, new, d]
    return o[0].transpose(0, 1)  # [new, heads, d]


CASES = [  # heads, kv_heads, head_dim, block_size, (cached, new) per chunk, sliding window (0: none)
    (9, 3, 64, 16, [(0, 150), (0, 32), (160, 100), (23, 17), (0, 2)], 0),
    (32, 8, 64, 16, [(0, 128), (236, 64)], 0),
    (4, 4, 128, 32, [(0, 70), (66, 33)], 0),
    (8, 1, 64, 1, [(0, 40), (33, 17)], 0),
    (6, 2, 64, 16, [(0, 700)], 0),
    (9, 3, 64, 16, [(0, 150), (160, 100), (23, 17)], 40),
    (4, 2, 128, 1, [(110, 90), (0, 300)], 33),
    (4, 2, 64, 16, [(0, 50)], 1),
    (8, 2, 128, 16, [(0, 1100), (900, 300), (77, 129)], 0),  # many 128-key softmax steps, partial last ones
    (6, 3, 64, 32, [(500, 700)], 200),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_native_prefill_is_as_exact_as_torchs_fused_kernel(kernels: Any, case: int) -> None:
    """Fresh prompts and chunks behind a cached prefix, lengths across tile (16) and key block (32) edges, GQA groups
    1-8, head_dim 64 and 128, block sizes 1-32, sliding windows shorter and longer than a key block. Each chunk's
    worst error against float64 stays within that of torch's bfloat16 SDPA on the same values (plus a quarter of a
    bfloat16 step), and rows no chunk owns are left untouched."""
    heads, kv_heads, head_dim, block_size, seqs, window = CASES[case]
    for sharpness in (1.0, 4.0):
        step = _random_step(heads, kv_heads, head_dim, block_size, seqs, seed=case, sharpness=sharpness)
        out = torch.full(step["q"].shape, 5.0, dtype=torch.bfloat16)
        firsts = [2 + sum(n for _, n in seqs[:i]) for i in range(len(seqs))]  # after the two unowned rows
        spans = torch.tensor([[first, n, c + n] for first, (c, n) in zip(firsts, seqs)])
        width = max(len(t) for t in step["tables"])
        tables = torch.tensor([t + [0] * (width - len(t)) for t in step["tables"]])
        kernels.prefill_attention(
            step["q"], step["k_cache"], step["v_cache"], tables, spans, head_dim**-0.5, window, out
        )
        assert torch.all(out[:2] == 5.0), "rows outside every chunk were written"
        row = 2
        for (cached, new), table in zip(seqs, step["tables"]):
            exact = _reference(step, row, cached, new, table, torch.float64, window)
            ours = (out[row : row + new].double() - exact).abs().max().item()
            theirs = (
                (_reference(step, row, cached, new, table, torch.bfloat16, window).double() - exact).abs().max().item()
            )
            scale = exact.abs().max().item()
            assert ours <= theirs + 2**-10 * scale, (sharpness, cached, new, ours, theirs)
            row += new


def test_paged_attention_takes_the_native_prefill_for_every_chunk_in_one_call(kernels: Any) -> None:
    """paged_attention hands all of a step's chunks (and only them) to the native op, once per layer, with the
    layer's window when it applies; with a soft cap or in float32 it keeps torch's path."""
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    seqs = [(0, 37), (21, 18), (30, 1)]
    step = _random_step(heads, kv_heads, head_dim, block_size, seqs, seed=9, sharpness=2.0)
    batch = build_attention_batch([c for c, _ in seqs], [n for _, n in seqs], step["tables"], block_size)
    calls: list[tuple[int, ...]] = []

    def counting(q: torch.Tensor, *args: Any) -> None:
        calls.append((*args[3][:, 1].tolist(), args[5]))
        kernels.prefill_attention(q, *args)

    q = step["q"][:56]
    k_new = torch.randn(56, kv_heads, head_dim).bfloat16()
    v_new = torch.randn(56, kv_heads, head_dim).bfloat16()
    native = paged_attention(
        q,
        k_new,
        v_new,
        step["k_cache"],
        step["v_cache"],
        batch,
        head_dim**-0.5,
        kernels.decode_attention,
        prefill_op=counting,
    )  # [56, heads * d]
    assert calls == [(37, 18, 0)]
    torch_path = paged_attention(
        q, k_new, v_new, step["k_cache"], step["v_cache"], batch, head_dim**-0.5, kernels.decode_attention
    )
    torch.testing.assert_close(native.float(), torch_path.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(native[55], torch_path[55]), "the decode row must come from the decode kernel either way"
    windowed = paged_attention(
        q,
        k_new,
        v_new,
        step["k_cache"],
        step["v_cache"],
        batch,
        head_dim**-0.5,
        kernels.decode_attention,
        window=8,
        prefill_op=counting,
    )
    assert calls[-1] == (37, 18, 8)
    torch_windowed = paged_attention(
        q, k_new, v_new, step["k_cache"], step["v_cache"], batch, head_dim**-0.5, kernels.decode_attention, window=8
    )
    torch.testing.assert_close(windowed.float(), torch_windowed.float(), atol=2e-2, rtol=2e-2)
    paged_attention(
        q,
        k_new,
        v_new,
        step["k_cache"],
        step["v_cache"],
        batch,
        head_dim**-0.5,
        kernels.decode_attention,
        softcap=30.0,
        prefill_op=counting,
    )
    fresh = build_attention_batch([c for c, _ in seqs], [n for _, n in seqs], step["tables"], block_size)
    paged_attention(
        q.float(),
        k_new.float(),
        v_new.float(),
        step["k_cache"].float(),
        step["v_cache"].float(),
        fresh,
        head_dim**-0.5,
        kernels.decode_attention,
        prefill_op=counting,
    )
    assert len(calls) == 2


def test_native_prefill_refuses_what_it_cannot_compute(kernels: Any) -> None:
    q = torch.randn(8, 4, 64)
    cache = torch.randn(2, 16, 2, 64)
    tables = torch.zeros(1, 1, dtype=torch.int64)
    spans = torch.tensor([[0, 8, 8]])
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.prefill_attention(q, cache, cache, tables, spans, 0.125, 0, torch.empty_like(q))
    qb, cb = q.bfloat16(), cache.bfloat16()
    with pytest.raises(RuntimeError, match="do not fit"):
        kernels.prefill_attention(qb, cb, cb, tables, torch.tensor([[4, 8, 8]]), 0.125, 0, torch.empty_like(qb))
    with pytest.raises(RuntimeError, match="do not fit"):
        kernels.prefill_attention(qb, cb, cb, tables, torch.tensor([[0, 8, 20]]), 0.125, 0, torch.empty_like(qb))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.prefill_attention(
            qb[..., :48].contiguous(),
            cb[..., :48].contiguous(),
            cb[..., :48].contiguous(),
            tables,
            spans,
            0.125,
            0,
            torch.empty(8, 4, 48, dtype=torch.bfloat16),
        )
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        kernels.prefill_attention(qb, cb, cb, tables, spans, 0.125, -1, torch.empty_like(qb))


def test_chunks_with_long_contexts_keep_torchs_kernel_beside_native_ones(kernels: Any) -> None:
    """Past NATIVE_PREFILL_MAX_CONTEXT tokens of context (not measured there) a chunk takes torch's fused kernel,
    the short chunks of the same step still go to the native op in one call, and every row matches the torch path."""
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    long_new = NATIVE_PREFILL_MAX_CONTEXT + 40
    seqs = [(0, 30), (0, long_new), (NATIVE_PREFILL_MAX_CONTEXT - 20, 30), (12, 20)]
    step = _random_step(heads, kv_heads, head_dim, block_size, seqs, seed=4, sharpness=2.0)
    tokens = sum(n for _, n in seqs)
    q, k_new, v_new = (
        step["q"][:tokens],
        torch.randn(tokens, kv_heads, head_dim).bfloat16(),
        torch.randn(tokens, kv_heads, head_dim).bfloat16(),
    )
    calls: list[list[int]] = []

    def counting(q: torch.Tensor, *args: Any) -> None:
        calls.append(args[3][:, 1].tolist())
        kernels.prefill_attention(q, *args)

    def batch() -> Any:
        return build_attention_batch([c for c, _ in seqs], [n for _, n in seqs], step["tables"], block_size)

    native = paged_attention(
        q, k_new, v_new, step["k_cache"], step["v_cache"], batch(), head_dim**-0.5, prefill_op=counting
    )  # [tokens, heads * d]
    assert calls == [[30, 20]], "the long chunk and the one behind a long prefix must not reach the native op"
    reference = paged_attention(q, k_new, v_new, step["k_cache"], step["v_cache"], batch(), head_dim**-0.5)
    torch.testing.assert_close(native.float(), reference.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(native[30 : 30 + long_new + 30], reference[30 : 30 + long_new + 30]), (
        "chunks past the native limit take exactly torch's path"
    )
