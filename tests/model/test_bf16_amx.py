"""bfloat16 weights packed once at load in AMX's tile layout and multiplied by our kernel (csrc/amx_product.cpp):
the product against float64 over the same bfloat16 weights, independent of the thread count and of how the rows
are split, the layout's round trip, the cases that keep oneDNN's pack, and a tiny model token for token."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model.layers import Projection, SiluGateProjection, interleave_gate_up, pack_bf16_tiles, unpack_bf16_tiles
from helpers.parity import Reference, compare
from helpers.tiny_models import build_tiny_model

BF16_TIE_GAP = 0.5  # as in test_parity_bf16: bfloat16 activations against a float32 reference
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def amx(native_kernels: Any) -> Any:
    if not native_kernels.bf16_amx_available():
        pytest.skip("this CPU (or kernel) offers no AMX-BF16 tiles; bfloat16 weights keep oneDNN's pack")
    return native_kernels


def _weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=generator) / 7).bfloat16()  # [out, in]


def _within_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """got equals x W^T in float64 over the same bfloat16 values, within float32 sums and one rounding."""
    exact = x.double() @ weight.double().t()  # [rows, out]
    rounded = exact.bfloat16().double()
    magnitude = x.double().abs() @ weight.double().abs().t()  # [rows, out]
    return bool(((got.double() - rounded).abs() <= rounded.abs() * 2**-8 + magnitude * 2**-16).all())


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 100, 260])
@pytest.mark.parametrize("out_features,in_features", [(37, 64), (50, 32), (96, 2048 + 96)])
def test_product_matches_float64_over_the_bfloat16_weights(
    rows: int, out_features: int, in_features: int, amx: Any
) -> None:
    """Row counts around the 16-row tiles and 32-row pairs, and past the 256 from which y is written with
    non-temporal stores; output widths that fill no 16- or 32-row block (37, 50) or do (96); one 32-column tile;
    two 2048-column panels, the last short."""
    weight = _weight(out_features, in_features, seed=rows + out_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
    got = amx.bf16_linear_amx(x, pack_bf16_tiles(weight), out_features)  # [rows, out]
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert _within_float64(got, x, weight)
    projection = Projection(weight, None, amx)
    assert projection.tiles is not None and projection.packed is None and projection.weight is None
    assert projection.panels is None  # the tiles are the only copy
    assert torch.equal(projection(x), got)


def test_product_is_the_same_on_one_thread_or_two_and_however_the_rows_are_split(amx: Any) -> None:
    """300 output rows (10 blocks of 32: units of work taken by whichever thread is free) by 300 activation rows of
    4096 (two panels, two chunks of rows): every value summed by one thread in one order."""
    weight = _weight(300, 4096, seed=5)
    tiles = pack_bf16_tiles(weight)
    x = torch.randn(300, 4096, generator=torch.Generator().manual_seed(3)).bfloat16()  # [300, 4096]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx.bf16_linear_amx(x, tiles, 300)  # [300, 300]
        torch.set_num_threads(2)
        two = amx.bf16_linear_amx(x, tiles, 300)  # [300, 300]
    finally:
        torch.set_num_threads(before)
    assert _within_float64(one, x, weight)
    assert torch.equal(one, two)
    pieces = [amx.bf16_linear_amx(x[a:b].contiguous(), tiles, 300) for a, b in ((0, 1), (1, 150), (150, 300))]
    assert torch.equal(one, torch.cat(pieces))


@pytest.mark.parametrize("rows", [17, 64])
def test_a_wide_output_written_past_the_caches_holds_the_same_values(rows: int, amx: Any) -> None:
    """An output of 1 MiB or more (a decode step's logits) is written with non-temporal stores whatever the row
    count: the same bits as the rows multiplied a few at a time (outputs that stay in the cache)."""
    out_features = (1 << 20) // (2 * 16) + 32  # over 1 MiB from 16 rows on
    weight = _weight(out_features, 64, seed=rows)
    tiles = pack_bf16_tiles(weight)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, 64]
    whole = amx.bf16_linear_amx(x, tiles, out_features)  # [rows, out]
    pieces = [amx.bf16_linear_amx(x[a : a + 4].contiguous(), tiles, out_features) for a in range(0, rows, 4)]
    assert 4 * out_features * 2 < 1 << 20 <= rows * out_features * 2  # the pieces' outputs stay in the cache
    assert torch.equal(whole, torch.cat(pieces))


@pytest.mark.parametrize("out_features", [1, 16, 37, 64])
def test_tiles_unpack_to_the_weights_and_pick_single_weights(out_features: int, amx: Any) -> None:
    """The layout's round trip (Projection.unpacked: tied embeddings, tensor-parallel splits read it back), and
    one-hot activation rows, whose products are single weights: the kernel reads every weight where it is."""
    weight = _weight(out_features, 96, seed=out_features)
    projection = Projection(weight, None, amx)
    assert torch.equal(projection.unpacked(), weight)
    assert torch.equal(unpack_bf16_tiles(pack_bf16_tiles(weight), out_features), weight)
    one_hot = torch.eye(96).bfloat16()  # [in, in]
    assert torch.equal(projection(one_hot), weight.t())
    strided = _weight(96, out_features, seed=2).t()  # [out, 96], not contiguous (a split or transposed view)
    assert torch.equal(Projection(strided, None, amx).unpacked(), strided)


@pytest.mark.parametrize("rows", [1, 17, 64, 200, 260])
@pytest.mark.parametrize("inner,in_features", [(16, 64), (48, 96), (64, 2048 + 96)])
def test_silu_gate_product_is_the_product_then_silu_and_mul_bit_for_bit(
    rows: int, inner: int, in_features: int, amx: Any
) -> None:
    """The gated MLP's product with the activation applied to its accumulators gives the bits of the plain
    product followed by the silu_and_mul op: one, two and three gate/up tile pairs (inner 16, 48, 64), one and two
    2048-column panels, rows around the tiles and past the plain product's non-temporal threshold."""
    weight = _weight(2 * inner, in_features, seed=rows + inner)  # [gate; up]
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [rows, in]
    separate = amx.silu_and_mul(amx.bf16_linear_amx(x, pack_bf16_tiles(weight), 2 * inner))  # [rows, inner]
    fused = SiluGateProjection(weight, amx)
    got = fused(x)  # [rows, inner]
    assert got.shape == (rows, inner) and got.dtype == torch.bfloat16
    assert torch.equal(got, separate)
    assert torch.equal(fused.unpacked(), weight)
    gate, up = x.double() @ weight[:inner].double().t(), x.double() @ weight[inner:].double().t()  # [rows, inner]
    reference = torch.nn.functional.silu(gate) * up
    assert torch.allclose(got.double(), reference, rtol=0.05, atol=0.05)  # and both compute the gated MLP


def test_the_silu_gate_product_applies_only_where_its_tiles_pair_up(amx: Any) -> None:
    """Halves that are no whole 16-row tiles keep the plain product and the separate op; tiles that are not an
    interleaved pair are refused by name."""
    assert SiluGateProjection.applies(_weight(64, 64, seed=1), amx)
    assert not SiluGateProjection.applies(_weight(2 * 24, 64, seed=1), amx)  # inner 24
    assert not SiluGateProjection.applies(_weight(64, 48, seed=1), amx)  # input width not a multiple of 32
    assert not SiluGateProjection.applies(_weight(64, 64, seed=1).float(), amx)
    weight = _weight(64, 64, seed=2)
    assert torch.equal(interleave_gate_up(weight)[16:32], weight[32:48])  # the first up rows follow 16 gate rows
    with pytest.raises(RuntimeError, match="not the interleaved gate and up rows of an inner width 48"):
        amx.bf16_silu_gate_amx(torch.randn(3, 64).bfloat16(), pack_bf16_tiles(weight), 48)


def test_what_the_kernel_cannot_multiply_keeps_onednn_or_is_refused(amx: Any) -> None:
    """A bias, or an input width not a multiple of 32: oneDNN's pack, as before (the same products). The kernel
    itself refuses float32 activations and tiles that do not fit, by name."""
    assert Projection(_weight(40, 48, seed=1), None, amx).tiles is None
    assert Projection(_weight(40, 64, seed=1), torch.zeros(40).bfloat16(), amx).tiles is None
    assert Projection(_weight(40, 64, seed=1).float(), None, amx).tiles is None
    tiles = pack_bf16_tiles(_weight(40, 64, seed=1))
    with pytest.raises(RuntimeError, match=r"x must be a CPU bfloat16 tensor \[rows, 64\]"):
        amx.bf16_linear_amx(torch.randn(3, 64), tiles, 40)
    with pytest.raises(RuntimeError, match=r"x must be a CPU bfloat16 tensor \[rows, 64\]"):
        amx.bf16_linear_amx(torch.randn(3, 96).bfloat16(), tiles, 40)
    with pytest.raises(RuntimeError, match="do not hold 70 output rows"):
        amx.bf16_linear_amx(torch.randn(3, 64).bfloat16(), tiles, 70)
    with pytest.raises(RuntimeError, match="from pack_bf16_tiles"):
        amx.bf16_linear_amx(torch.randn(3, 64).bfloat16(), tiles.reshape(-1, 32), 40)
    assert amx.bf16_linear_amx(torch.zeros(0, 64).bfloat16(), tiles, 40).shape == (0, 40)


def _greedy(llm: Any, prompts: list[list[int]], logprobs: int | None = None) -> Any:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_tiny_bf16_model_matches_float32_and_onednn_token_for_token(tmp_path: Any, amx: Any) -> None:
    """A tiny tied-embedding bfloat16 model on our kernel, one request alone and all at once with prefill chunks,
    against a float32 forward over the same weights (kernels='torch'), near-ties excepted, and against the oneDNN
    path it replaces (kernels='torch' in bfloat16) where neither meets a near-tie. The LM head's tiles are its only
    copy beside the embedding."""
    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder, tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (5, 17, 40, 64)]
    common: dict[str, Any] = dict(model=folder, kv_cache_memory="16MiB", max_model_len=256, max_num_batched_tokens=48)
    reference = LLM(dtype="float32", kernels="torch", **common)
    refs = [
        Reference(o.token_ids, [lp.top[0][1] - lp.top[1][1] for lp in o.logprobs or []])
        for o in _greedy(reference, prompts, logprobs=2)
    ]
    ours = LLM(dtype="bfloat16", kernels="native", **common)
    model = ours.engine.runner.model
    assert model.layers[0].qkv.tiles is not None and model.lm_head.tiles is not None
    assert model.layers[0].silu_gate is not None and model.layers[0].gate_up is None  # activation in the product
    assert model.lm_head.weight is None and model.lm_head.packed is None
    got = [_greedy(ours, [p])[0].token_ids for p in prompts[:2]] + [o.token_ids for o in _greedy(ours, prompts)[2:]]
    ties = compare(refs, got, allow_ties=True, tie_gap=BF16_TIE_GAP)
    onednn = LLM(dtype="bfloat16", kernels="torch", **common)
    assert onednn.engine.runner.model.layers[0].qkv.tiles is None
    theirs = [o.token_ids for o in _greedy(onednn, prompts)]
    assert compare(refs, theirs, allow_ties=True, tie_gap=BF16_TIE_GAP) >= 0
    for i, (a, b) in enumerate(zip(got, theirs)):
        first = next((j for j in range(len(a)) if a[j] != b[j]), None)
        assert first is None or refs[i].top2_gap[first] < BF16_TIE_GAP, (i, first)
    print(f"tiny bfloat16 on AMX tiles: {ties} of {len(prompts)} sequences diverged at a reference near-tie")
    ours.engine.check_idle()


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 100, 260])
@pytest.mark.parametrize("out_features,in_features", [(37, 64), (50, 32), (96, 2048 + 96), (4099, 576)])
def test_argmax_product_is_the_argmax_of_the_bfloat16_product(
    rows: int, out_features: int, in_features: int, amx: Any
) -> None:
    """bf16_linear_argmax_amx against torch's max(dim=-1).indices over bf16_linear_amx's output, on one thread and
    two: small integer weights and inputs (the products are exact, so most rows hold many equal maxima: the first
    must win), a weight row repeated far away (equal outputs in every row), and, where wide enough, columns of
    +-inf and NaN (the first NaN wins) that differ row by row. The shapes cover blocks the output width leaves short
    (37, 50, 4099), one 32-column tile, two input panels, and one to many chunks of rows."""
    generator = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randint(-2, 3, (out_features, in_features), generator=generator).bfloat16()  # [out, in]
    x = torch.randint(-2, 3, (rows, in_features), generator=generator).bfloat16()  # [rows, in]
    weight[out_features - 1] = weight[out_features // 3]
    if out_features > 64:
        weight[out_features // 2, 5] = float("inf")  # +inf, -inf or (x = 0 there: inf * 0) NaN, row by row
        weight[17, :2] = 3e38  # products past float32's range: +-inf or NaN, or finite, depending on the row
    tiles = pack_bf16_tiles(weight)
    reference = amx.bf16_linear_amx(x, tiles, out_features).max(dim=-1).indices  # [rows]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            got = amx.bf16_linear_argmax_amx(x, tiles, out_features)  # [rows]
            assert got.dtype == torch.int64 and torch.equal(got, reference), count
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(Projection(weight, None, amx).first_argmax(x), reference)
    assert amx.bf16_linear_argmax_amx(x[:0], tiles, out_features).shape == (0,)
    with pytest.raises(RuntimeError, match="do not hold"):
        amx.bf16_linear_argmax_amx(x, tiles, out_features + 32)


def test_greedy_steps_take_the_argmax_from_the_lm_head_product(tmp_path: Any, amx: Any, monkeypatch: Any) -> None:
    """A tiny bfloat16 model's greedy requests (alone and batched, with prefill chunks) give the same tokens with the
    LM head's argmax product as with the logits written and sampled; a request asking for logprobs, and a sampled
    one, still take the logits."""
    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder, tie_word_embeddings=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (5, 17, 40, 64)]
    llm = LLM(
        model=folder,
        dtype="bfloat16",
        kernels="native",
        kv_cache_memory="16MiB",
        max_model_len=256,
        max_num_batched_tokens=48,
    )
    model = llm.engine.runner.model
    assert model.lm_head.computes_argmax
    calls = {"fused": 0}
    fused = type(model).greedy_tokens

    def counted(self: Any, hidden: torch.Tensor) -> Any:
        tokens = fused(self, hidden)
        calls["fused"] += tokens is not None
        return tokens

    monkeypatch.setattr(type(model), "greedy_tokens", counted)
    got = [_greedy(llm, [p])[0].token_ids for p in prompts[:2]] + [o.token_ids for o in _greedy(llm, prompts)]
    assert calls["fused"] > 0
    monkeypatch.setattr(type(model), "greedy_tokens", lambda self, hidden: None)
    expected = [_greedy(llm, [p])[0].token_ids for p in prompts[:2]] + [o.token_ids for o in _greedy(llm, prompts)]
    assert got == expected
    monkeypatch.setattr(type(model), "greedy_tokens", counted)
    calls["fused"] = 0
    with_logprobs = _greedy(llm, prompts[:1], logprobs=1)[0]
    sampled = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.8, seed=3), use_tqdm=False)
    assert calls["fused"] == 0 and with_logprobs.token_ids == expected[0] and len(sampled[0].outputs[0].token_ids) == 4
    llm.engine.check_idle()
