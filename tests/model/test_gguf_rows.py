"""The few-rows GGUF kernel (gguf_linear_rows / gguf_linear_rows_parts) where its int8 dot products unpack a
weight block once for several activation rows and split a stack of parts between threads by weight bytes:
against float64 over the dequantized weights (within the int8 rounding bound of test_gguf_quant), and exactly
against the same product one activation row at a time and on one thread."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_gguf_quant import _kernels, random_blocks

from conveyor.model.gguf_quant import INT8_DOT_TYPES, QuantizedWeight


def _within_int8_rounding(got: torch.Tensor, x: torch.Tensor, parts: list[QuantizedWeight]) -> bool:
    """|got - x W^T| within the bound test_gguf_quant uses for activations rounded to int8 per group."""
    w = torch.cat([p.dequantize() for p in parts]).double()  # [out, in]
    exact = x.double() @ w.t()  # [rows, out]
    magnitude = x.double().abs() @ w.abs().t()
    rounding = torch.zeros_like(exact)
    first = 0
    for p in parts:
        group = INT8_DOT_TYPES.get(p.kind)  # None: the exact float path
        if group is not None:
            step = x.double().reshape(x.shape[0], -1, group).abs().amax(-1) / 127  # [rows, in / group]
            rounding[:, first : first + p.shape[0]] = (
                step.repeat_interleave(group, dim=1) / 2
            ) @ p.dequantize().double().abs().t()
        first += p.shape[0]
    return bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 + rounding * 1.001 + magnitude * 2**-16).all())


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7])
def test_rows_at_once_equal_each_row_alone(kind: str, rows: int, request: pytest.FixtureRequest) -> None:
    """1..4 activation rows share one unpacking of each weight block (more go 4 at a time): the same floats as
    each row alone, and near float64. Widths as in a 1B model's layers (2048) and an odd number of blocks."""
    kernels = _kernels(request)
    for in_features in (2048, 768):
        weight = random_blocks(kind, 29, in_features, seed=rows)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
        got = kernels.gguf_linear_rows(x, weight.blocks, weight.type_id, in_features)  # [rows, 29]
        alone = torch.cat(
            [kernels.gguf_linear_rows(x[m : m + 1], weight.blocks, weight.type_id, in_features) for m in range(rows)]
        )
        assert torch.equal(got, alone)
        assert _within_int8_rounding(got, x, [weight])


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_mixed_stack_split_by_bytes_equals_one_thread(rows: int, request: pytest.FixtureRequest) -> None:
    """A stack of Q4_K, Q6_K, Q8_0 and Q5_K (float path) parts large enough to be split between threads, at
    1, 2 and 3 threads (the shares' edges fall inside the first Q4_K part and inside the Q6_K one): the same
    floats as on one thread and as each part alone, within the int8 rounding bound of float64."""
    kernels = _kernels(request)
    in_features = 512
    parts = [
        random_blocks(kind, n, in_features, seed=n)
        for kind, n in (("Q4_K", 251), ("Q6_K", 61), ("Q8_0", 20), ("Q4_K", 3), ("Q6_K", 1), ("Q5_K", 7))
    ]
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
    blocks, kinds = [p.blocks for p in parts], [p.type_id for p in parts]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = kernels.gguf_linear_rows_parts(x, blocks, kinds, in_features)  # [rows, 343]
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(kernels.gguf_linear_rows_parts(x, blocks, kinds, in_features), single), threads
    finally:
        torch.set_num_threads(before)
    alone = torch.cat([kernels.gguf_linear_rows(x, p.blocks, p.type_id, in_features) for p in parts], dim=1)
    assert single.shape == (rows, 343) and torch.equal(single, alone)
    assert _within_int8_rounding(single, x, parts)


def test_float32_rows_keep_the_exact_path(request: pytest.FixtureRequest) -> None:
    """float32 activations are not quantized: 1..4 rows within float32 rounding of float64."""
    kernels: Any = _kernels(request)
    weight = random_blocks("Q6_K", 23, 1024, seed=3)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(3))  # [4, in]
    w = weight.dequantize().double()
    got = kernels.gguf_linear_rows(x, weight.blocks, weight.type_id, 1024)
    assert ((got.double() - x.double() @ w.t()).abs() <= (x.double().abs() @ w.abs().t()) * 1e-5).all()
