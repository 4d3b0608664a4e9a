"""GGUF-quantized weights kept compact: the native kernels on random valid blocks against the `gguf` package's
reference dequantization, the load-time quantizers, and tiny models of every kept-compact type (GGUF files
written from random weights) against a float32 forward over the same dequantized weights."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import EngineConfig
from conveyor.errors import ConfigError
from conveyor.model import gguf_projection, gguf_quant
from conveyor.model.gguf_projection import PACKED_ROWS_MIN, ROWS_MAX, GGUFProjection, GGUFSiluGate, rows_max
from conveyor.model.gguf_quant import (
    FORMATS,
    INT8_DOT_TYPES,
    QuantizedWeight,
    RowStack,
    cat_rows,
    place_weights,
    quantize,
)
from conveyor.model.layers import interleave_gate_up, pack_bf16_tiles
from helpers.gguf_convert import ConverterUnavailable, convert, rewrite
from helpers.parity import Reference, compare
from helpers.tiny_models import build_tiny_model

TIE_GAP = 0.5  # as in test_parity_bf16: activations rounded to bfloat16 or int8 against a float32 reference
NEW_TOKENS = 24


def _kernels(request: pytest.FixtureRequest) -> Any:
    kernels = request.getfixturevalue("native_kernels")
    if not kernels.gguf_linear_vectorized():
        pytest.skip("the GGUF kernels need AVX2 + FMA or AVX-512 VNNI; this CPU dequantizes at load")
    return kernels


def random_blocks(kind: str, rows: int, in_features: int, seed: int) -> QuantizedWeight:
    """Random bytes, with every float16 scale field finite and small: valid blocks of any bit pattern."""
    fmt = FORMATS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, in_features // fmt.block, fmt.block_bytes), dtype=np.uint8)
    halves = {"Q6_K": (208,), "Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,)}.get(kind, (0, 2))  # d (and m / dmin)
    for offset in halves:
        scale = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)  # [rows, blocks]
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return QuantizedWeight(kind, torch.from_numpy(raw.reshape(rows, -1)), in_features)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_native_dequantization_is_the_reference_one(kind: str, request: pytest.FixtureRequest) -> None:
    kernels = _kernels(request)
    in_features = 3 * FORMATS[kind].block
    weight = random_blocks(kind, 37, in_features, seed=FORMATS[kind].type_id)
    got = kernels.gguf_dequantize(weight.blocks, weight.type_id, in_features)  # [37, in]
    assert torch.equal(got, weight.dequantize())


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 33, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_match_float64_over_the_dequantized_weights(
    kind: str, rows: int, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    """Both kernels at every row count (the projection picks one by rows_max), odd output widths, input widths
    of an odd number of blocks; bias added."""
    kernels = _kernels(request)
    out_features, in_features = 37, 3 * FORMATS[kind].block
    weight = random_blocks(kind, out_features, in_features, seed=rows).with_dtype(dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)  # [rows, in]
    bias = torch.randn(out_features, generator=gen).to(dtype)  # [out]
    w = weight.dequantize().double()  # [out, in]
    magnitude = x.double().abs() @ w.abs().t()  # [rows, out]: bounds every partial sum
    exact = x.double() @ w.t()  # [rows, out]
    projection = GGUFProjection(weight, bias, kernels)
    amx = dtype == torch.bfloat16 and kernels.gguf_amx_available()
    for name in ("gguf_linear_rows", "gguf_linear_tiles", *(("gguf_linear_amx",) if amx else ())):
        got = getattr(kernels, name)(x, weight.blocks, weight.type_id, in_features)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        if dtype == torch.float32:
            assert ((got.double() - exact).abs() <= magnitude * 1e-5).all(), name
        elif name == "gguf_linear_rows" and kind in INT8_DOT_TYPES:  # activations rounded to int8 per group
            group = INT8_DOT_TYPES[kind]
            step = x.double().reshape(rows, -1, group).abs().amax(-1) / 127  # [rows, in / group]
            rounding = (step.repeat_interleave(group, dim=1) / 2) @ w.abs().t()  # [rows, out]: half a step each
            assert (
                (got.double() - exact).abs() <= exact.abs() * 2**-8 + rounding * 1.001 + magnitude * 2**-16
            ).all(), name
        elif name == "gguf_linear_rows":  # exact products, float32 sums, one bfloat16 rounding
            assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * 2**-16).all(), name
        else:  # the tile's weights rounded to bfloat16 first
            assert _within_bf16_weights(got, x, weight), name
    if dtype == torch.float32 and kind in INT8_DOT_TYPES:  # float32 activations rounded to int8 where asked
        got = kernels.gguf_linear_rows(x, weight.blocks, weight.type_id, in_features, int8_float32=True)
        group = INT8_DOT_TYPES[kind]
        step = x.double().reshape(rows, -1, group).abs().amax(-1) / 127  # [rows, in / group]
        rounding = (step.repeat_interleave(group, dim=1) / 2) @ w.abs().t()  # [rows, out]: half a step each
        assert ((got.double() - exact).abs() <= rounding * 1.001 + magnitude * 2**-16).all()
        rounded = _int8_activations(x, group).double()  # [rows, in]: llama.cpp's Q8 activations, as the kernel rounds
        assert ((got.double() - rounded @ w.t()).abs() <= (rounded.abs() @ w.abs().t()) * 2**-16).all()
        assert not torch.equal(got, kernels.gguf_linear_rows(x, weight.blocks, weight.type_id, in_features))
        blocks, kind_id = weight.blocks, weight.type_id
        alone = [kernels.gguf_linear_rows(x[m : m + 1], blocks, kind_id, in_features, True) for m in range(rows)]
        assert torch.equal(got, torch.cat(alone))  # a row's sums do not depend on the rows beside it
    if rows <= rows_max(x):  # the row kernel, float32 activations rounded to int8 as bfloat16 ones are
        direct = kernels.gguf_linear_rows(x, weight.blocks, weight.type_id, in_features, int8_float32=True)
    else:
        product = kernels.gguf_linear_amx if amx else kernels.gguf_linear_tiles
        direct = product(x, weight.blocks, weight.type_id, in_features)
    assert torch.equal(projection(x), direct + bias)


def _int8_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, in] float32 rounded as the int8 dot products round it: per `group` columns, scale = max |x| / 127 and
    q = x * (127 / max |x|) rounded to the nearest integer (ties to even) -> scale * q [rows, in] float32."""
    blocks = x.reshape(x.shape[0], -1, group)  # [rows, in / group, group]
    amax = blocks.abs().amax(-1, keepdim=True)  # [rows, in / group, 1]
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127)).reshape(x.shape)


def _within_bf16_weights(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """got [rows, out] is x W^T with W rounded to bfloat16, summed in float32 and rounded once to x's dtype:
    within half a bfloat16 step of the float64 product over the same rounded weights, plus float32 sums."""
    w = weight.dequantize().bfloat16().double()  # [out, in]
    rounded = x.double() @ w.t()  # [rows, out]
    magnitude = x.double().abs() @ w.abs().t()  # [rows, out]
    return bool(((got.double() - rounded).abs() <= rounded.abs() * 2**-8 + magnitude * 2**-16).all())


def _amx(request: pytest.FixtureRequest) -> Any:
    kernels = _kernels(request)
    if not kernels.gguf_amx_available():
        pytest.skip("this CPU (or kernel) offers no AMX-BF16 tiles; many-row products take gguf_linear_tiles")
    return kernels


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("rows", [5, 16, 17, 64, 300])
def test_amx_products_match_float64_over_the_bfloat16_weights(
    kind: str, rows: int, request: pytest.FixtureRequest
) -> None:
    """The AMX kernel at row counts around its 16-row tiles and 32-row pairs of tiles, output widths that fill
    no 16- or 32-row weight block, input widths of an odd number of 32-column tiles, wider than one panel at 64
    and 300 rows (300: two chunks of packed activations, the last partial); equal to float64 over the weights
    rounded to bfloat16 within float32 sums and one rounding; the projection's choice for many bfloat16 rows."""
    kernels = _amx(request)
    block = FORMATS[kind].block
    # 300 rows of 8192: four 2048-column panels, two chunks of packed rows (256 + 44); 64 of 2048 + 3 blocks: a
    # short last panel
    in_features = {300: 8192, 64: 2048 + 3 * block}.get(rows, 3 * block)
    for out_features in (37, 50):
        weight = random_blocks(kind, out_features, in_features, seed=rows + out_features)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
        got = kernels.gguf_linear_amx(x, weight.blocks, weight.type_id, in_features)  # [rows, out]
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        assert _within_bf16_weights(got, x, weight)
        projection = GGUFProjection(weight, None, kernels)
        assert torch.equal(projection(x), got)  # the projection takes this kernel for many bfloat16 rows


@pytest.mark.parametrize("in_features", [512, 4096])
def test_amx_products_do_not_depend_on_how_the_work_is_split(in_features: int, request: pytest.FixtureRequest) -> None:
    """300 weight rows (10 blocks of 32: several units of work, the last partial) by 300 activation rows (two
    chunks at 2048-column panels), one panel or two: within the float64 bound, and each row's output the same
    when its rows are multiplied alone or with others (units taken by whichever thread is free, each thread
    packing its own chunk)."""
    kernels = _amx(request)
    weight = random_blocks("Q4_K", 300, in_features, seed=in_features)
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(3)).bfloat16()  # [300, in]
    got = kernels.gguf_linear_amx(x, weight.blocks, weight.type_id, in_features)  # [300, 300]
    assert _within_bf16_weights(got, x, weight)
    pieces = [
        kernels.gguf_linear_amx(x[a:b].contiguous(), weight.blocks, weight.type_id, in_features)
        for a, b in ((0, 7), (7, 150), (150, 300))
    ]
    assert torch.equal(got, torch.cat(pieces))


@pytest.mark.parametrize("in_features", [2048, 8192])
def test_prompt_sized_products_take_the_packed_path_from_its_row_count(
    in_features: int, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The projection dequantizes a stack once into packed tiles from packed_rows_min rows (fewer for an input wider
    than one 2048-column panel, which the per-chunk product would dequantize once per chunk of 256 rows), not one row
    before; either way the per-chunk product's bits, within the float64 bound (a stack of Q4_K, Q6_K and Q5_K's
    float path, 2085 rows, the last block partial)."""
    kernels = _amx(request)
    first = gguf_projection.packed_rows_min(in_features)
    assert first == (gguf_projection.PACKED_ROWS_MIN_WIDE if in_features > 2048 else PACKED_ROWS_MIN)
    parts = [random_blocks(kind, n, in_features, seed=n) for kind, n in (("Q4_K", 2048), ("Q6_K", 30), ("Q5_K", 7))]
    projection = GGUFProjection(RowStack(tuple(parts)), None, kernels)  # type: ignore[arg-type]
    blocks, kinds = [p.blocks for p in parts], [p.type_id for p in parts]
    packs: list[bool] = []
    original = gguf_projection.packed_tiles

    def counted(*args: Any) -> torch.Tensor:
        packs.append(args[-1])
        return original(*args)

    monkeypatch.setattr(gguf_projection, "packed_tiles", counted)
    w = torch.cat([p.dequantize() for p in parts]).bfloat16().double()  # [2085, in]
    for rows in (first - 1, first):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
        got = projection(x)  # [rows, 2085]
        assert packs == ([False] if rows == first else [])
        packs.clear()
        assert torch.equal(got, kernels.gguf_linear_amx_parts(x, blocks, kinds, in_features))
        exact = x.double() @ w.t()  # [rows, 2085]
        magnitude = x.double().abs() @ w.abs().t()
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * 2**-16).all()


def test_packed_tiles_are_the_dequantized_weights_in_the_bf16_layout(request: pytest.FixtureRequest) -> None:
    """gguf_pack_tiles over a stack of every kept-compact type (160 rows, some padded past the last tile): exactly
    pack_bf16_tiles of the reference dequantization rounded to bfloat16, plain and with the gate and up halves
    interleaved (interleave_gate_up); a tiles tensor of the wrong shape is refused by name."""
    kernels = _amx(request)
    in_features = 512
    parts = [
        random_blocks(kind, n, in_features, seed=n)
        for kind, n in (
            ("Q4_K", 40),
            ("Q6_K", 24),
            ("Q8_0", 16),
            ("Q4_0", 15),
            ("Q4_1", 17),
            ("Q5_0", 9),
            ("Q5_1", 23),
            ("Q5_K", 16),
        )
    ]
    assert {p.kind for p in parts} == set(FORMATS)
    blocks, kinds = [p.blocks for p in parts], [p.type_id for p in parts]
    dense = torch.cat([p.dequantize() for p in parts]).bfloat16()  # [160, in]
    for gate_up, weight in ((False, dense), (True, interleave_gate_up(dense)), (False, dense[:144])):
        expected = pack_bf16_tiles(weight)  # [10, 16, 16, 32]
        got = torch.full_like(expected, float("nan"))
        stack = (blocks, kinds) if weight.shape[0] == 160 else (blocks[:7], kinds[:7])
        kernels.gguf_pack_tiles(*stack, in_features, gate_up, got)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), gate_up
    with pytest.raises(RuntimeError, match=r"tiles must be a contiguous CPU bfloat16 tensor \[10, 16, 16, 32\]"):
        kernels.gguf_pack_tiles(blocks, kinds, in_features, False, torch.empty(4, 16, 16, 32, dtype=torch.bfloat16))


def test_prompt_step_products_on_packed_tiles_give_the_per_chunk_bits(request: pytest.FixtureRequest) -> None:
    """From packed_rows_min rows the projection multiplies the weights dequantized once into packed tiles
    (bf16_linear_amx), and a SiLU MLP's gate/up applies the activation inside that product (bf16_silu_gate_amx):
    the same bits as the per-chunk AMX product (and the separate silu_and_mul), for a mixed stack two panels wide."""
    kernels = _amx(request)
    in_features = 2048 + 256
    parts = [random_blocks(kind, n, in_features, seed=n) for kind, n in (("Q4_K", 48), ("Q6_K", 16))]
    stack = RowStack(tuple(parts))  # type: ignore[arg-type]
    blocks, kinds = [p.blocks for p in parts], [p.type_id for p in parts]
    projection = GGUFProjection(stack, None, kernels)
    gate = GGUFSiluGate(projection)
    assert GGUFSiluGate.applies(projection) and gate.inner == 32
    for rows in (PACKED_ROWS_MIN, PACKED_ROWS_MIN + 37):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
        per_chunk = kernels.gguf_linear_amx_parts(x, blocks, kinds, in_features)  # [rows, 64]
        assert torch.equal(projection(x), per_chunk)
        assert torch.equal(gate(x), kernels.silu_and_mul(per_chunk))
    few = torch.randn(9, in_features, generator=torch.Generator().manual_seed(9)).bfloat16()  # [9, in]
    assert torch.equal(gate(few), kernels.silu_and_mul(kernels.gguf_linear_amx_parts(few, blocks, kinds, in_features)))


def test_busy_decode_steps_fuse_the_silu_gate_into_the_block_product(request: pytest.FixtureRequest) -> None:
    """Between ROWS_MAX + 1 and packed_rows_min rows (a busy decode step) a SiLU MLP's gate/up is dequantized block by
    block in interleave_gate_up's order and the activation is applied as the product stores
    (gguf_silu_gate_amx_parts): the same bits as the row product then silu_and_mul, for a stack of three types whose
    gate and up halves each span two parts, an odd number of 32-row blocks, and inputs of one and of two panels."""
    kernels = _amx(request)
    for in_features in (512, 2048 + 256):
        parts = [random_blocks(kind, n, in_features, seed=n) for kind, n in (("Q4_K", 40), ("Q6_K", 24), ("Q8_0", 32))]
        blocks, kinds = [p.blocks for p in parts], [p.type_id for p in parts]
        gate = GGUFSiluGate(GGUFProjection(RowStack(tuple(parts)), None, kernels))  # type: ignore[arg-type]
        assert gate.inner == 48
        for rows in (ROWS_MAX + 1, 64, 131):
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
            expected = kernels.silu_and_mul(kernels.gguf_linear_amx_parts(x, blocks, kinds, in_features))  # [rows, 48]
            fused = kernels.gguf_silu_gate_amx_parts(x, blocks, kinds, in_features)
            assert torch.equal(fused.view(torch.int16), expected.view(torch.int16)), (in_features, rows)
            assert torch.equal(gate(x).view(torch.int16), expected.view(torch.int16)), (in_features, rows)
    x = torch.randn(8, 512).bfloat16()
    with pytest.raises(RuntimeError, match=r"halves split into 16-row tiles; got 48 rows"):
        kernels.gguf_silu_gate_amx_parts(x, [random_blocks("Q8_0", 48, 512, seed=1).blocks], [8], 512)


def test_engine_prompt_steps_on_packed_tiles_give_the_per_chunk_tokens(
    tiny_f32_gguf: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A Q4_K_M-style file (Q4_K and Q6_K) in bfloat16 with one prompt step of ~900 tokens (the packed path for every
    projection) against the same engine with that path switched off: the same tokens and the same logprobs."""
    _amx(request)
    path = _quantized_file(tiny_f32_gguf, _MIXED, str(tmp_path))
    rng = np.random.default_rng(11)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (200, 230, 250, 221)]
    common: dict[str, Any] = dict(
        model=path,
        kv_cache_memory="32MiB",
        max_model_len=512,
        dtype="bfloat16",
        kernels="native",
        gguf_weights="compact",
    )
    packs: list[bool] = []  # gate_up of each packing, to see that the path ran
    original = gguf_projection.packed_tiles

    def counted(*args: Any) -> torch.Tensor:
        packs.append(args[-1])
        return original(*args)

    monkeypatch.setattr(gguf_projection, "packed_tiles", counted)
    results = []
    for packed_from in (PACKED_ROWS_MIN, 10**9):
        monkeypatch.setattr(gguf_projection, "packed_rows_min", lambda in_features, rows=packed_from: rows)
        llm = LLM(**common)
        results.append([(o.token_ids, [lp.top for lp in o.logprobs or []]) for o in _greedy(llm, prompts, logprobs=2)])
        llm.engine.check_idle()
        layers = len(llm.engine.runner.model.layers)
        # the first run: one prompt step of all prompts, every layer's QKV, O and down plain, gate/up fused
        assert (packs.count(False), packs.count(True)) == ((3 * layers, layers) if packed_from < 10**9 else (0, 0))
        packs.clear()
    assert results[0] == results[1]


@pytest.mark.parametrize("kind", list(FORMATS))
def test_many_row_dequantization_is_exact(kind: str, request: pytest.FixtureRequest) -> None:
    """One-hot activation rows pick single weights: the many-rows kernels' outputs are then their dequantized
    bfloat16 weights themselves (one exact product, no sum), equal to the reference dequantization rounded to
    bfloat16: gguf_linear_tiles' (where AMX is absent; every type through gguf_bf16.cpp's dequantizer, or the float
    path where the build has no AVX-512 BF16) and, where AMX is here, gguf_linear_amx's."""
    kernels = _kernels(request)
    in_features = 3 * FORMATS[kind].block
    weight = random_blocks(kind, 37, in_features, seed=7)
    one_hot = torch.eye(in_features).bfloat16()  # [in, in]
    expected = weight.dequantize().bfloat16().t()  # [in, 37] = W^T
    assert torch.equal(kernels.gguf_linear_tiles(one_hot, weight.blocks, weight.type_id, in_features), expected)
    if kernels.gguf_amx_available():
        assert torch.equal(kernels.gguf_linear_amx(one_hot, weight.blocks, weight.type_id, in_features), expected)


def test_amx_product_refuses_what_it_cannot_multiply(request: pytest.FixtureRequest) -> None:
    kernels = _amx(request)
    weight = random_blocks("Q4_K", 40, 256, seed=1)
    with pytest.raises(RuntimeError, match="multiplies bfloat16 activations, got Float; use gguf_linear_tiles"):
        kernels.gguf_linear_amx(torch.randn(20, 256), weight.blocks, weight.type_id, 256)
    with pytest.raises(RuntimeError, match="do not hold 512 weights"):
        kernels.gguf_linear_amx(torch.randn(20, 512).bfloat16(), weight.blocks, weight.type_id, 512)
    empty = kernels.gguf_linear_amx(torch.zeros(0, 256).bfloat16(), weight.blocks, weight.type_id, 256)
    assert empty.shape == (0, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_stacked_parts_in_one_call_equal_each_part_alone(
    dtype: torch.dtype, rows: int, request: pytest.FixtureRequest
) -> None:
    """A fused QKV of mixed types (as in Q4_K_M files) and a type without int8 dot products: one call over the
    stack (x quantized to int8 once, float32 or bfloat16) gives exactly the separate products side by side, and
    within the rounding bound of float64 over the dequantized weights; the projection uses it for few rows."""
    kernels = _kernels(request)
    in_features = 512
    parts = [random_blocks(kind, n, in_features, seed=n) for kind, n in (("Q4_K", 40), ("Q6_K", 9), ("Q5_K", 7))]
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)  # [rows, in]
    blocks, kinds = [p.blocks for p in parts], [p.type_id for p in parts]
    got = kernels.gguf_linear_rows_parts(x, blocks, kinds, in_features, int8_float32=True)
    alone = torch.cat([kernels.gguf_linear_rows(x, p.blocks, p.type_id, in_features, True) for p in parts], dim=1)
    assert got.dtype == dtype and got.shape == (rows, 56) and torch.equal(got, alone)
    w = torch.cat([p.dequantize() for p in parts]).double()  # [56, in]
    exact = x.double() @ w.t()  # [rows, 56]
    magnitude = x.double().abs() @ w.abs().t()
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * 0.02).all()
    projection = GGUFProjection(RowStack(tuple(parts)), None, kernels)  # type: ignore[arg-type]
    assert torch.equal(projection(x), got)
    with pytest.raises(RuntimeError, match="one type id per block matrix"):
        kernels.gguf_linear_rows_parts(x, [parts[0].blocks], [], in_features)


@pytest.mark.parametrize("rows, in_features", [(37, 512), (16, 2048 + 256)])
def test_amx_stacked_parts_in_one_call_equal_each_part_alone(
    rows: int, in_features: int, request: pytest.FixtureRequest
) -> None:
    """Many rows of a mixed-type stack (Q4_K / Q6_K as in a Q4_K_M file's fused QKV, and Q5_K's float path) on
    AMX tiles in one call: a 32-row weight block spanning all three parts, one and two column panels; exactly the
    parts' own products side by side (no torch.cat), and what the projection gives for many bfloat16 rows."""
    kernels = _amx(request)
    parts = [random_blocks(kind, n, in_features, seed=n) for kind, n in (("Q4_K", 40), ("Q6_K", 9), ("Q5_K", 7))]
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
    got = kernels.gguf_linear_amx_parts(x, [p.blocks for p in parts], [p.type_id for p in parts], in_features)
    alone = torch.cat([kernels.gguf_linear_amx(x, p.blocks, p.type_id, in_features) for p in parts], dim=1)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 56) and torch.equal(got, alone)
    projection = GGUFProjection(RowStack(tuple(parts)), None, kernels)  # type: ignore[arg-type]
    assert torch.equal(projection(x), got)
    with pytest.raises(RuntimeError, match="one type id per block matrix"):
        kernels.gguf_linear_amx_parts(x, [parts[0].blocks], [], in_features)


def test_kernels_refuse_blocks_that_do_not_fit(request: pytest.FixtureRequest) -> None:
    kernels = _kernels(request)
    weight = random_blocks("Q4_K", 4, 256, seed=0)
    with pytest.raises(RuntimeError, match="do not hold 512 weights"):
        kernels.gguf_linear_rows(torch.randn(1, 512), weight.blocks, weight.type_id, 512)
    with pytest.raises(RuntimeError, match="no native kernel"):
        kernels.gguf_linear_rows(torch.randn(1, 256), weight.blocks, 10, 256)  # Q2_K


@pytest.mark.parametrize("kind", list(FORMATS))
def test_load_time_quantizers_round_trip_through_the_reference(kind: str) -> None:
    """quantize() writes blocks that gguf's own dequantizer reads back close to the weights."""
    gen = torch.Generator().manual_seed(FORMATS[kind].type_id)
    w = torch.randn(12, 512, generator=gen)  # [out, in]
    w[0] = w[0].abs()  # all positive
    w[1] = -w[1].abs()  # all negative
    w[2, :256] = 0  # an all-zero block
    q = quantize(w, kind)
    assert q.blocks.shape == (12, 512 // FORMATS[kind].block * FORMATS[kind].block_bytes)
    back = q.dequantize()  # [out, in]
    assert torch.equal(back[2, :256], torch.zeros(256))
    bound = {"Q8_0": 0.01, "Q6_K": 0.04, "Q5_0": 0.06, "Q5_1": 0.06, "Q5_K": 0.06}.get(kind, 0.12)
    assert ((back - w).norm() / w.norm()).item() < bound


def test_config_names_the_quantizations() -> None:
    with pytest.raises(ConfigError, match="'q3_k' is not supported; choose one of .*q4_k"):
        LLM(quantization="q3_k")
    with pytest.raises(ConfigError, match="'q4_k' computes with bfloat16 activations"):
        LLM(quantization="q4_k", dtype="float32")
    with pytest.raises(ConfigError, match="gguf_weights='packed' is not supported; choose one of auto, compact"):
        LLM(gguf_weights="packed")


def test_compact_weights_need_the_native_kernels() -> None:
    with pytest.raises(
        ConfigError,
        match="gguf_weights='compact' was requested, but the native kernels are not "
        "in use.*use gguf_weights='auto' or 'dequantize'",
    ):
        LLM(kernels="torch", gguf_weights="compact", kv_cache_memory="16MiB", max_model_len=256)


def test_the_small_default_model_is_dequantized_under_auto(default_llm: Any) -> None:
    """auto keeps blocks compact from 1 GiB of dequantized weights: the 135M default model in an asked-for float32
    stays as before."""
    assert isinstance(default_llm.engine.runner.model.embed, torch.Tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_keeps_large_weights_compact_and_dequantizes_small_ones(
    dtype: torch.dtype, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """place_weights under gguf_weights='auto': weights under COMPACT_AUTO_BYTES dequantized, past it kept compact,
    in either dtype; gguf_weights='compact' keeps them so at any size."""
    kernels = _kernels(request)
    weights = {"w": random_blocks("Q4_K", 64, 256, seed=1).with_dtype(dtype)}
    cpu = torch.device("cpu")
    dense = place_weights(weights, cpu, kernels, "auto")["w"]
    assert isinstance(dense, torch.Tensor) and dense.dtype == dtype
    monkeypatch.setattr(gguf_quant, "COMPACT_AUTO_BYTES", 0)
    large = place_weights(weights, cpu, kernels, "auto")["w"]
    assert isinstance(large, QuantizedWeight)
    kept = place_weights(weights, cpu, kernels, "compact")["w"]
    assert isinstance(kept, QuantizedWeight)
    assert torch.equal(GGUFProjection(kept, None, kernels).unpacked(), weights["w"].dequantize())


# --- tiny models ------------------------------------------------------------------------------------------

_MIXED = "Q4_K_M"  # Q4_K with Q6_K for V, down and the output matrix, as llama.cpp's Q4_K_M mixes them


def _type_of(name: str, kind: str) -> str:
    if kind != _MIXED:
        return kind
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"


@pytest.fixture(scope="module")
def tiny_f32_gguf(tmp_path_factory: Any) -> str:
    """A tiny random Llama (widths multiples of 256, as K-quants need) converted by llama.cpp's converter."""
    folder = str(tmp_path_factory.mktemp("gguf-quant-hf"))
    build_tiny_model("llama", folder, hidden_size=256, intermediate_size=512, initializer_range=0.05)
    try:
        return convert(folder, os.path.join(str(tmp_path_factory.mktemp("gguf-quant-f32")), "model-f32.gguf"))
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter is unavailable here: {exc}")


def _quantized_file(source: str, kind: str, folder: str) -> str:
    """The file with every 2-D weight quantized (gguf_quant.quantize) to `kind`."""
    import gguf

    reader = gguf.GGUFReader(source)
    tensors = {}
    for t in reader.tensors:
        if len(t.shape) == 2:
            values = np.asarray(t.data, dtype=np.float32)  # [rows, cols]
            target = _type_of(t.name, kind)
            tensors[t.name] = (
                quantize(torch.from_numpy(values.copy()), target).blocks.numpy(),
                gguf.GGMLQuantizationType[target],
            )
    return rewrite(source, os.path.join(folder, f"model-{kind}.gguf"), tensors=tensors)


def _greedy(llm: Any, prompts: list[list[int]], logprobs: int | None = None) -> Any:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", [*FORMATS, _MIXED])
def test_tiny_model_greedy_matches_float32_over_the_dequantized_weights(
    kind: str, tiny_f32_gguf: str, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    """Ours with the weights kept compact (bfloat16 and float32 activations, both rounded to int8 in few-row
    products) against kernels='torch', where the same file is dequantized at load by the `gguf` package and run in
    float32: token for token, near-ties excepted. One request alone (the row kernel) and all at once with prefill
    chunks (the tile kernel past the row kernel's rows; with bfloat16 activations the AMX kernel where the CPU has
    one)."""
    _kernels(request)
    path = _quantized_file(tiny_f32_gguf, kind, str(tmp_path))
    rng = np.random.default_rng(len(kind))
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (5, 17, 40, 64)]
    common: dict[str, Any] = dict(model=path, kv_cache_memory="16MiB", max_model_len=256)
    reference = LLM(dtype="float32", kernels="torch", **common)
    refs = [
        Reference(o.token_ids, [lp.top[0][1] - lp.top[1][1] for lp in o.logprobs or []])
        for o in _greedy(reference, prompts, logprobs=2)
    ]
    for dtype in ("float32", "bfloat16"):
        ours = LLM(dtype=dtype, kernels="native", gguf_weights="compact", **common)
        model = ours.engine.runner.model
        assert isinstance(model.embed, QuantizedWeight) and isinstance(model.layers[0].silu_gate, GGUFSiluGate)
        assert all(isinstance(p, QuantizedWeight) for p in model.layers[0].qkv.parts)  # no float copy
        got = [_greedy(ours, [p])[0].token_ids for p in prompts[:2]] + [o.token_ids for o in _greedy(ours, prompts)[2:]]
        ties = compare(refs, got, allow_ties=True, tie_gap=TIE_GAP)
        print(f"{kind} {dtype}: {ties} of {len(prompts)} sequences diverged at a reference near-tie")
        ours.engine.check_idle()


def test_hf_folder_quantized_at_load_keeps_the_blocks(
    tiny_f32_gguf: str, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    """quantization='q4_k' on a checkpoint folder: compact decoder weights and a Q8_0 LM head, generating."""
    _kernels(request)
    folder = str(tmp_path / "hf")
    build_tiny_model("llama", folder, hidden_size=256, intermediate_size=512, initializer_range=0.05)
    llm = LLM(model=folder, quantization="q4_k", kv_cache_memory="16MiB", max_model_len=256)
    model = llm.engine.runner.model
    assert model.layers[0].silu_gate.projection.parts[0].kind == "Q4_K" and model.lm_head.parts[0].kind == "Q8_0"
    out = _greedy(llm, [[3, 4, 5, 6]])[0]
    assert len(out.token_ids) == NEW_TOKENS
    llm.engine.check_idle()


def test_rows_of_one_type_are_merged_and_mixed_types_kept_apart() -> None:
    """Fused QKV of a Q4_K_M layer: Q and K (Q4_K) become one block matrix, V (Q6_K) its own part."""
    q, k, v = (random_blocks(kind, rows, 256, seed=rows) for kind, rows in (("Q4_K", 8), ("Q4_K", 4), ("Q6_K", 4)))
    stacked = cat_rows([q, k, v])
    assert isinstance(stacked, RowStack) and [p.kind for p in stacked.parts] == ["Q4_K", "Q6_K"]  # type: ignore
    assert stacked.shape == (16, 256)
    assert torch.equal(stacked.dequantize(), torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]))
    merged = cat_rows([q, k])
    assert isinstance(merged, QuantizedWeight) and torch.equal(merged.blocks, torch.cat([q.blocks, k.blocks]))


def test_the_old_int4_name_still_works() -> None:
    assert EngineConfig(quantization="int4").quantization == "int4_latency"
