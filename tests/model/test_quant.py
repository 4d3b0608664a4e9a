"""int4 weight-only: the format round trip, both kernel paths, config errors, and the default model
against its own reference (float32 over the same dequantized weights)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from conveyor import LLM, SamplingParams
from conveyor.errors import ConfigError
from conveyor.model.layers import Projection
from conveyor.model.quant import (
    GROUP_SIZE,
    LM_HEAD_INT8_ROWS,
    LM_HEAD_INT8_ROWS_NATIVE,
    SMALL_BATCH_ROWS,
    Int4Projection,
    Int8Projection,
    dequantize_int4,
    dequantize_int8,
    make_lm_head,
    make_projection,
    pack_int4_blocks,
    pack_int8_rows,
    quantize_int4,
)
from helpers.parity import Reference, compare

NEW_TOKENS = 32
BF16_TIE_GAP = 0.5  # as in test_parity_bf16: int4 runs with bfloat16 activations


def test_round_trip_error_is_within_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 4 * GROUP_SIZE)  # [out, in]
    codes, scale, zero = quantize_int4(w)
    assert codes.min() >= 0 and codes.max() <= 15
    err = (dequantize_int4(codes, scale, zero) - w).abs().reshape(48, 4, GROUP_SIZE).amax(-1)  # [out, groups]
    assert (err <= scale.float() * 0.5 + scale.float().abs() * 2**-7 * 8 + 1e-6).all()


def test_q4_1_style_grid_is_recovered_exactly() -> None:
    """Weights on a min + q * step grid (as GGUF Q4_1 dequantizes them, both ends used) come back unchanged."""
    gen = torch.Generator().manual_seed(1)
    groups = 32 * 3
    step = torch.tensor([2.0**-e for e in torch.randint(4, 9, (groups,), generator=gen).tolist()])  # bf16-exact
    low = -8 * step  # a bf16-exact minimum
    q = torch.randint(0, 16, (groups, GROUP_SIZE), generator=gen)
    q[:, 0], q[:, 1] = 0, 15
    w = (low[:, None] + q * step[:, None]).reshape(32, 3 * GROUP_SIZE)  # [out, in]
    assert torch.equal(dequantize_int4(*quantize_int4(w)), w)


def _kernels(backend: str, request: pytest.FixtureRequest) -> Any:
    """None for torch's int4/int8 kernels; the native module (skipped where it cannot be built or is not
    vectorized here, since then the projections fall back to torch's kernels)."""
    if backend == "torch":
        return None
    kernels = request.getfixturevalue("native_kernels")
    if not kernels.quant_linear_vectorized():
        pytest.skip("the native quantized products need AVX-512 BF16; this CPU uses torch's")
    return kernels


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_projection_multiplies_by_the_dequantized_weights(
    rows: int, bias: bool, backend: str, request: pytest.FixtureRequest
) -> None:
    torch.manual_seed(rows)
    w = torch.randn(64, 3 * GROUP_SIZE) / 10  # [out, in]
    b = torch.randn(64) if bias else None  # [out]
    proj = make_projection(w, b, "int4_latency", _kernels(backend, request))
    assert isinstance(proj, Int4Projection)
    assert (proj.blocks is not None) == (backend == "native")
    deq = dequantize_int4(*quantize_int4(w))  # [out, in] float32
    x = torch.randn(rows, 3 * GROUP_SIZE).to(torch.bfloat16)  # [rows, in]
    got = proj(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 64)
    strided = torch.zeros(rows, 2 * 3 * GROUP_SIZE, dtype=torch.bfloat16)[:, ::2]  # the same rows, not contiguous
    strided.copy_(x)
    assert torch.equal(proj(strided), got)
    exact = x.float() @ deq.t() + (0 if b is None else b.to(torch.bfloat16).float())  # [rows, out]
    if rows > SMALL_BATCH_ROWS:  # the bfloat16 copy: F.linear over the bf16-rounded dequantized weights
        assert torch.equal(got, F.linear(x, deq.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16)))
    assert (got.float() - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 64])
def test_int8_lm_head_multiplies_by_its_dequantized_weights(
    rows: int, backend: str, request: pytest.FixtureRequest
) -> None:
    torch.manual_seed(rows)
    w = (torch.randn(320, 96) / 10).to(torch.bfloat16)  # [vocab, hidden]
    head = make_lm_head(w, "int4_latency", _kernels(backend, request))
    assert isinstance(head, Int8Projection) and head.codes.dtype == torch.int8
    assert head.max_rows == (LM_HEAD_INT8_ROWS if backend == "torch" else LM_HEAD_INT8_ROWS_NATIVE)
    deq = head.dequantized()  # [vocab, hidden] float32
    assert torch.equal(
        deq, dequantize_int8(torch.round(w.float() / head.scale.float()[:, None]).to(torch.int8), head.scale)
    )
    assert ((deq - w.float()).abs() <= head.scale.float()[:, None] / 2 + 1e-6).all()  # within half a step
    x = torch.randn(rows, 96).to(torch.bfloat16)
    got = head(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 320)
    strided = torch.zeros(rows, 192, dtype=torch.bfloat16)[:, ::2]  # the same rows, not contiguous
    strided.copy_(x)
    assert torch.equal(head(strided), got)
    exact = x.float() @ deq.t()  # [rows, vocab]
    if rows > head.max_rows:  # the bfloat16 copy of the same dequantized weights
        assert torch.equal(got, F.linear(x, deq.to(torch.bfloat16)))
    assert (got.float() - exact).abs().max() <= 0.01 * exact.abs().max()
    assert isinstance(make_lm_head(w, None), Projection)


def test_shapes_the_kernel_cannot_take_stay_unquantized() -> None:
    assert isinstance(
        make_projection(torch.randn(40, 64), None, "int4_latency"), Projection
    )  # out not a multiple of 16
    assert isinstance(make_projection(torch.randn(64, 48), None, "int4_latency"), Projection)  # in not whole groups
    assert isinstance(make_projection(torch.randn(64, 64), None, None), Projection)


def test_config_errors_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="dtype='bfloat16'"):
        LLM(quantization="int4", dtype="float32")
    with pytest.raises(ConfigError, match="'int8' is not supported; choose one of"):
        LLM(quantization="int8", dtype="bfloat16")


@pytest.fixture(scope="module")
def int4_case(default_llm: Any) -> tuple[list[list[int]], Any, Any]:
    tok = default_llm.get_tokenizer()
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?"]
    raw = ["1, 2, 3, 4,", "The quick brown fox", "def fibonacci(n):\n"]
    chat = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    prompts = [tok(p).input_ids for p in chat + raw]
    ours = LLM(dtype="bfloat16", quantization="int4", kv_cache_memory="64MiB", max_model_len=512)
    reference = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    for layer in reference.engine.runner.model.layers:  # float32 over exactly the weights int4 multiplies by
        for name in ("qkv", "o_proj", "gate_up", "down"):
            proj = getattr(layer, name)
            deq = dequantize_int4(*quantize_int4(proj.unpacked()))
            setattr(layer, name, Projection(deq.to(torch.bfloat16).float(), proj.bias))
    head = ours.engine.runner.model.lm_head  # int8 rows, untied from the embedding
    reference.engine.runner.model.lm_head = Projection(head.dequantized())
    return prompts, ours, reference


def _greedy(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


def test_default_model_int4_greedy_matches_its_reference(int4_case: tuple[list[list[int]], Any, Any]) -> None:
    prompts, ours, reference = int4_case
    # batch of 1 (int4 kernel) and a batch of 6 with prefill chunks (bf16 copy for >8 rows)
    got = [_greedy(ours, [p])[0] for p in prompts[:2]] + _greedy(ours, prompts)[2:]
    ref_outs = reference.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2), use_tqdm=False
    )
    refs = [
        Reference(o.outputs[0].token_ids, [lp.top[0][1] - lp.top[1][1] for lp in o.outputs[0].logprobs or []])
        for o in ref_outs
    ]
    ties = compare(refs, got, allow_ties=True, tie_gap=BF16_TIE_GAP)
    print(f"int4: {ties} of {len(prompts)} sequences diverged at a reference near-tie")
    ours.engine.check_idle()


def test_default_model_int4_adds_no_error_beyond_bf16(int4_case: tuple[list[list[int]], Any, Any]) -> None:
    """Teacher-forced: |int4 logprob - reference logprob| no larger than plain bfloat16's distance from float32."""
    prompts, ours, reference = int4_case
    sequences = [p + c for p, c in zip(prompts, _greedy(reference, prompts))]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    bf16 = LLM(dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512)
    plain32 = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    runs = {
        name: llm.generate(sequences, params, use_tqdm=False)
        for name, llm in (("int4", ours), ("ref", reference), ("bf16", bf16), ("fp32", plain32))
    }
    int4_err, bf16_err = [], []
    for i, (seq, prompt) in enumerate(zip(sequences, prompts)):
        for pos in range(len(prompt), len(seq)):
            lp = {name: outs[i].prompt_logprobs[pos].logprob for name, outs in runs.items()}  # type: ignore[index]
            int4_err.append(abs(lp["int4"] - lp["ref"]))
            bf16_err.append(abs(lp["bf16"] - lp["fp32"]))
    int4_mean, bf16_mean = sum(int4_err) / len(int4_err), sum(bf16_err) / len(bf16_err)
    print(
        f"mean |logprob error| over {len(int4_err)} tokens: int4 vs its float32 reference {int4_mean:.4f}, "
        f"bfloat16 vs float32 {bf16_mean:.4f}"
    )
    assert int4_mean <= 1.5 * bf16_mean + 1e-3, (int4_mean, bf16_mean)


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9])
def test_native_int4_is_exact_up_to_output_rounding(
    shape: tuple[int, int], rows: int, request: pytest.FixtureRequest
) -> None:
    """Against float64 over the same dequantized weights: products exact, sums in float32, one bfloat16
    rounding at the end; every row count, including those past the register-blocked 4 (the kernel takes
    rows in fours) and those the projection would send to the bfloat16 copy."""
    kernels = _kernels("native", request)
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    w = torch.randn(out_features, in_features, generator=gen) / 10  # [out, in]
    codes, scale, zero = quantize_int4(w)
    blocks = pack_int4_blocks(codes, scale, zero)  # [out / 16, in / 32, 320]
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)  # [rows, in]
    got = kernels.int4_linear(x, blocks, None).double()  # [rows, out]
    deq = dequantize_int4(codes, scale, zero).double()  # [out, in]
    exact = x.double() @ deq.t()  # [rows, out]
    magnitude = x.double().abs() @ deq.abs().t()  # [rows, out]: bounds every partial sum
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + magnitude * 2**-16).all()


def test_native_quant_products_reject_bad_inputs_with_reasons(request: pytest.FixtureRequest) -> None:
    kernels = _kernels("native", request)
    w = torch.randn(32, 64)  # [out, in]
    blocks = pack_int4_blocks(*quantize_int4(w))
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weights take 64"):
        kernels.int4_linear(x[:, :32].contiguous(), blocks, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.int4_linear(x.float(), blocks, None)
    with pytest.raises(RuntimeError, match="pack_int4_blocks"):
        kernels.int4_linear(x, blocks.view(-1), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.int4_linear(x, blocks, torch.zeros(31, dtype=torch.bfloat16))
    codes = pack_int8_rows(torch.randint(-127, 128, (32, 64), dtype=torch.int8))
    with pytest.raises(RuntimeError, match="scale must be"):
        kernels.int8_linear(x, codes, torch.ones(32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="no input columns"):
        kernels.int4_linear(x[:, :0].contiguous(), torch.zeros(2, 0, 320, dtype=torch.uint8), None)
    assert kernels.int4_linear(x[:0], blocks, None).shape == (0, 32)


def test_int4_packing_follows_the_documented_layout() -> None:
    """Reads pack_int4_blocks' bytes back by the layout csrc/quant_linear.cpp documents (runs on any CPU)."""
    gen = torch.Generator().manual_seed(5)
    out_features, in_features = 48, 3 * GROUP_SIZE
    codes, scale, zero = quantize_int4(torch.randn(out_features, in_features, generator=gen))
    blocks = pack_int4_blocks(codes, scale, zero)  # [out / 16, in / 32, 320]
    assert blocks.shape == (3, 3, 320) and blocks.dtype == torch.uint8
    raw = blocks.tolist()
    for n in range(out_features):
        b, r = divmod(n, 16)
        for k in range(in_features):
            g, col = divmod(k, GROUP_SIZE)
            t, rest = divmod(col, 4)  # quad t holds columns 4t..4t+3
            high, p = divmod(rest, 2)  # columns 4t+p in the low nibble, 4t+2+p in the high one
            byte = raw[b][g][32 * t + 2 * r + p]
            assert (byte >> 4 if high else byte & 15) == codes[n, k]
        for g in range(in_features // GROUP_SIZE):
            as_bf16 = torch.tensor(
                raw[b][g][256 + 2 * r : 258 + 2 * r] + raw[b][g][288 + 2 * r : 290 + 2 * r], dtype=torch.uint8
            ).view(torch.bfloat16)
            assert as_bf16[0] == scale[n, g] and as_bf16[1] == zero[n, g]


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_native_int8_head_is_exact_up_to_output_rounding(rows: int, request: pytest.FixtureRequest) -> None:
    """A head wide enough to be split between threads, and an input width (97) that leaves a remainder
    after the kernel's unrolled columns."""
    kernels = _kernels("native", request)
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(4096, 97, generator=gen) / 10).to(torch.bfloat16)  # [vocab, hidden]
    head = make_lm_head(w, "int4_latency", kernels)
    assert isinstance(head, Int8Projection) and head.kernels is not None
    x = torch.randn(rows, 97, generator=gen).to(torch.bfloat16)  # [rows, hidden]
    got = head(x).double()  # [rows, vocab]
    deq = head.dequantized().double()  # [vocab, hidden]
    exact = x.double() @ deq.t()
    magnitude = x.double().abs() @ deq.abs().t()
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + magnitude * 2**-16).all()
