"""The native float32 product (csrc/f32_linear.cpp) behind layers.Projection: its panel layout, its
exactness against float64 on every register-block size, thread split and chunking, the large-batch
path through torch's GEMM, and its input checks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from conveyor.model.layers import F32_NATIVE_MAX_ROWS, Projection, pack_f32_panels

DEPTH = 128  # input columns the kernel sums in registers before adding into the output (csrc/f32_linear.cpp)


def _vectorized(native_kernels: Any) -> Any:
    if not native_kernels.f32_linear_vectorized():
        pytest.skip("the native float32 product needs AVX-512; this CPU uses torch's GEMM")
    return native_kernels


def _error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Elementwise bound for float32 sums of chains no longer than DEPTH products, then one addition
    per chunk and the bias: n * u * sum |x_k w_k| (+ |b|), with u = 2^-24."""
    k = x.shape[1]
    chain = min(k, DEPTH) + math.ceil(k / DEPTH) + 2
    magnitude = x.double().abs() @ weight.double().abs().T  # [rows, out]
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return chain * 2.0**-24 * magnitude + 1e-30


def test_packing_follows_the_documented_layout() -> None:
    """panels[p, k, c] = W[32 p + c, k], zero past the last output row (runs on any CPU)."""
    weight = torch.arange(70 * 5, dtype=torch.float32).reshape(70, 5)  # [out, in]
    panels = pack_f32_panels(weight)
    assert panels.shape == (3, 5, 32) and panels.is_contiguous()
    for p in range(3):
        for c in range(32):
            row = 32 * p + c
            expected = weight[row] if row < 70 else torch.zeros(5)
            assert torch.equal(panels[p, :, c], expected), (p, c)


@pytest.mark.parametrize("out_features,in_features", [(32, 7), (50, 64), (96, 300), (1000, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 25, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_native_product_is_within_the_float32_bound(
    native_kernels: Any, out_features: int, in_features: int, rows: int, bias: bool
) -> None:
    kernels = _vectorized(native_kernels)
    gen = torch.Generator().manual_seed(out_features * 7 + in_features + rows)
    weight = torch.randn(out_features, in_features, generator=gen)  # [out, in]
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
    projection = Projection(weight, b, kernels)
    assert projection.panels is not None and projection.weight is None  # one layout kept, the native one
    got = projection(x)
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())  # [rows, out]
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= _error_bound(x, weight, b)).all()


def test_chunked_rows_and_thread_split_are_exact(native_kernels: Any) -> None:
    """Rows beyond one L2 chunk (768 KiB of activations: 128 rows at 1536 columns; 301 rows make three
    chunks, the last one shorter), a panel count split between threads, a bias, and strided input rows
    (made contiguous by the projection)."""
    kernels = _vectorized(native_kernels)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(4096 + 16, 1530, generator=gen)  # [out, in]: 129 panels, the last half full
    bias = torch.randn(4096 + 16, generator=gen)
    x = torch.randn(301, 2 * 1530, generator=gen)[:, ::2]  # [301, 1530], column stride 2
    got = Projection(weight, bias, kernels)(x)
    exact = x.double() @ weight.double().T + bias.double()
    assert ((got.double() - exact).abs() <= _error_bound(x, weight, bias)).all()


def test_empty_batches_and_outputs(native_kernels: Any) -> None:
    kernels = _vectorized(native_kernels)
    assert Projection(torch.randn(40, 16), None, kernels)(torch.randn(0, 16)).shape == (0, 40)
    assert kernels.f32_linear(torch.randn(3, 16), torch.empty(0, 16, 32), 0, None).shape == (3, 0)


@pytest.mark.parametrize("bias", [False, True])
def test_batches_above_the_native_limit_use_torch_gemm_over_the_same_weights(native_kernels: Any, bias: bool) -> None:
    kernels = _vectorized(native_kernels)
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(80, 48, generator=gen)  # [out, in]
    b = torch.randn(80, generator=gen) if bias else None
    x = torch.randn(F32_NATIVE_MAX_ROWS + 3, 48, generator=gen)  # [rows, in]
    got = Projection(weight, b, kernels)(x)
    reference = Projection(weight, b)(x)  # torch's GEMM against W^T stored contiguous
    assert torch.allclose(got, reference, rtol=1e-5, atol=1e-5)
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    assert ((got.double() - exact).abs() <= 4 * _error_bound(x, weight, b)).all()


def test_other_dtypes_and_no_kernels_keep_torch_layouts(native_kernels: Any) -> None:
    weight = torch.randn(70, 32)  # [out, in]
    assert Projection(weight).panels is None  # no kernels given: torch's GEMM over W^T
    assert torch.equal(Projection(weight).unpacked(), weight)
    if native_kernels.f32_linear_vectorized():
        assert torch.equal(Projection(weight, None, native_kernels).unpacked(), weight)
    assert Projection(weight.to(torch.bfloat16), None, native_kernels).panels is None
    assert Projection(weight.to(torch.float16), None, native_kernels).panels is None


def test_native_product_rejects_bad_inputs_with_reasons(native_kernels: Any) -> None:
    kernels = _vectorized(native_kernels)
    panels = pack_f32_panels(torch.randn(40, 16))  # [2, 16, 32]
    x = torch.randn(3, 16)
    cases = [
        (lambda: kernels.f32_linear(x.double(), panels, 40, None), "x must be a contiguous [rows, in] float32"),
        (lambda: kernels.f32_linear(torch.randn(3, 15), panels, 40, None), "x has 15 columns, the weights take 16"),
        (lambda: kernels.f32_linear(x, panels.transpose(1, 2), 40, None), "panels must be contiguous"),
        (lambda: kernels.f32_linear(x, panels, 65, None), "out_features=65 does not match 2 panels"),
        (lambda: kernels.f32_linear(x, panels, 32, None), "out_features=32 does not match 2 panels"),
        (lambda: kernels.f32_linear(x, torch.empty(0, 16, 32), -5, None), "out_features=-5 does not match 0 panels"),
        (lambda: kernels.f32_linear(x, panels, 40, torch.randn(39)), "bias must be a contiguous [out] float32"),
        (lambda: kernels.f32_linear(x, torch.empty(2, 0, 32), 40, None), "panels have no input columns"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
            call()
