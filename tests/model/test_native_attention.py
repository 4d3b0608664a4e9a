"""The native CPU kernels against references: decode attention against float64 on every code path it has,
the fused norm and activation against the torch ops they replace, and the engine across both backends."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conveyor import LLM
from conveyor.errors import ConfigError
from conveyor.model import native
from conveyor.model.attention import write_kv
from conveyor.model.layers import apply_rotary, rms_norm, silu_and_mul
from conveyor.model.model_spec import RopeSpec
from conveyor.model.native import NoToolchain, resolve_kernels
from conveyor.model.rope import RotaryEmbedding
from helpers.tiny_models import build_tiny_model


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per sequence: its first ctx cached tokens, plain SDPA with GQA, in `dtype`."""
    kv_heads = k_cache.shape[2]
    out = []
    for i in range(q.shape[0]):
        ctx = int(lens[i])
        k = k_cache[tables[i]].flatten(0, 1)[:ctx].to(dtype).transpose(0, 1)  # [kv_heads, ctx, d]
        v = v_cache[tables[i]].flatten(0, 1)[:ctx].to(dtype).transpose(0, 1)
        qi = q[i].to(dtype)[:, None, :]  # [heads, 1, d]
        o = F.scaled_dot_product_attention(qi, k, v, scale=scale, enable_gqa=kv_heads != q.shape[1])
        out.append(o[:, 0])
    return torch.stack(out)  # [seqs, heads, d]


# head_dim 64 and 128 with groups 1..8 take the AVX-512 path (where the CPU has it), bfloat16 at head_dim 64 with
# groups 1..4 its leaner variant (groups 3, 1, 4, 2 here); head_dim 8 and group 9 take the portable one; float16
# always the portable one.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 64), (4, 2, 64), (8, 1, 128), (6, 2, 8), (9, 1, 64)]
)
@pytest.mark.parametrize("block_size", [1, 4, 5, 16])
def test_kernel_matches_float64_reference(
    native_kernels: native.NativeKernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    num_blocks, seqs = 96, 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 37, 2, 5 * block_size])  # [seqs]
    max_blocks = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in range(seqs)])
    # q as a strided view (a slice of a wider tensor), the way the model hands it over
    wide = torch.randn(seqs, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q = wide[:, :heads]  # [seqs, heads, head_dim]
    scale = head_dim**-0.5
    got = native_kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    exact = _reference(q, k_cache, v_cache, tables, lens, scale, torch.float64)
    same_dtype = _reference(q, k_cache, v_cache, tables, lens, scale, dtype)  # SDPA in the same dtype
    err = (got.double() - exact).abs().max().item()
    sdpa_err = (same_dtype.double() - exact).abs().max().item()
    assert got.shape == q.shape and got.dtype == dtype
    # no less exact than torch's own SDPA in this dtype (float32: ~1e-7; bfloat16: ~1e-2)
    assert err <= max(2 * sdpa_err, 1e-6), (err, sdpa_err)


# A peaked softmax: scores hundreds apart, so that most exponentials underflow to zero (the vector exp's clamped
# range, libmvec's scalar path) and one key takes nearly all the weight.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 128), (6, 2, 8)])
def test_kernel_matches_float64_reference_when_the_softmax_underflows(
    native_kernels: native.NativeKernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(heads + head_dim)
    num_blocks, block_size, seqs = 64, 16, 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 17, 100, 211, 256])  # [seqs]
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:16] for _ in range(seqs)])
    q = (40 * torch.randn(seqs, heads, head_dim, generator=gen)).to(dtype)  # scores ~ +-40 sqrt(head_dim) apart
    scale = head_dim**-0.5
    got = native_kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    exact = _reference(q, k_cache, v_cache, tables, lens, scale, torch.float64)
    same_dtype = _reference(q, k_cache, v_cache, tables, lens, scale, dtype)
    assert torch.isfinite(got).all()
    err = (got.double() - exact).abs().max().item()
    sdpa_err = (same_dtype.double() - exact).abs().max().item()
    # float32: scores of magnitude ~400 carry ~3e-5 of rounding (one ulp), and the weights that relative error
    assert err <= max(2 * sdpa_err, 5e-5), (err, sdpa_err)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
def test_kernel_gives_the_same_bits_however_many_threads_split_the_sequences(
    native_kernels: native.NativeKernels, heads: int, kv_heads: int
) -> None:
    """The items (sequence x KV head) are split into ranges of about equal length, so the split moves with the
    thread count and the contexts (here 1 to 300 tokens); each item's result must not."""
    gen = torch.Generator().manual_seed(heads)
    block_size, num_blocks = 16, 400
    lens = torch.tensor([300, 1, 17, 250, 2, 64, 129, 5, 31, 200, 16, 90])  # [seqs]
    max_blocks = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in range(len(lens))])
    k_cache = torch.randn(num_blocks, block_size, kv_heads, 64, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, 64, generator=gen).bfloat16()
    q = torch.randn(len(lens), heads, 64, generator=gen).bfloat16()  # [seqs, heads, head_dim]
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(native_kernels.decode_attention(q, k_cache, v_cache, tables, lens, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    exact = _reference(q, k_cache, v_cache, tables, lens, 0.125, torch.float64)
    assert (results[0].double() - exact).abs().max().item() < 0.05


def test_kernel_rejects_bad_inputs_with_reasons(native_kernels: native.NativeKernels) -> None:
    kernel = native_kernels.decode_attention
    cache = torch.zeros(4, 4, 2, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(torch.zeros(1, 2, 8, dtype=torch.float64), cache, cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        kernel(torch.zeros(1, 2, 8), cache, cache, tables.int(), lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        kernel(torch.zeros(1, 3, 8), cache, cache, tables, lens, 1.0)
    # a context past its table or a block id outside the cache would read memory outside the cache
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] is 5; each must be in 1..4"):
        kernel(torch.zeros(1, 2, 8), cache, cache, tables, torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] is 0"):
        kernel(torch.zeros(1, 2, 8), cache, cache, tables, torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match=r"block_tables\[1\]\[1\] is 4; .* in 0..3"):
        kernel(torch.zeros(2, 2, 8), cache, cache, torch.tensor([[0, 1], [2, 4]]), torch.tensor([8, 5]), 1.0)
    with pytest.raises(RuntimeError, match=r"block_tables\[0\]\[0\] is -1"):
        kernel(torch.zeros(1, 2, 8), cache, cache, torch.tensor([[-1]]), lens, 1.0)
    # entries past a context's blocks are padding and not read: any value passes
    out = kernel(torch.zeros(1, 2, 8), cache, cache, torch.tensor([[3, -7]]), torch.tensor([4]), 1.0)
    assert out.shape == (1, 2, 8)


def test_loading_the_kernels_leaves_denormals_alone(native_kernels: native.NativeKernels) -> None:
    """-ffast-math is a compile flag only; linked in, it would switch the process to flush-to-zero."""
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a float32 denormal
    assert (tiny * 0.5).item() != 0.0


@pytest.mark.parametrize("head_dim", [16, 64])
def test_engine_tokens_match_between_backends(tmp_path: Path, head_dim: int) -> None:
    """The engine on the native kernel and on the torch reference: identical greedy tokens
    (head_dim 64 takes the kernel's AVX-512 path, 16 its portable one)."""
    from conveyor import SamplingParams

    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder, hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2)
    prompts = [[5 + i, 17, 3 * i + 1, 40, 2] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "native"):
        try:
            llm = LLM(model=folder, kernels=backend, async_batching=False, dtype="float32")
        except ConfigError as exc:
            pytest.skip(str(exc))
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["native"] == outs["torch"]


def test_backend_choice_errors_and_fallback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="kernels='bogus' is not supported"):
        LLM(kernels="bogus")
    with pytest.raises(ConfigError, match="cannot run on cuda"):
        resolve_kernels("native", torch.device("cuda"))
    assert resolve_kernels("auto", torch.device("cuda")) is None
    assert resolve_kernels("torch", torch.device("cpu")) is None

    def unavailable(wait: bool = True) -> None:
        raise NoToolchain("building the native kernels needs c++ on PATH (install g++)")

    monkeypatch.setattr(native, "load_kernels", unavailable)
    with pytest.raises(ConfigError, match="needs c\\+\\+ on PATH .*kernels='auto'"):
        resolve_kernels("native", torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="conveyor.model.native"):
        assert resolve_kernels("auto", torch.device("cpu")) is None
    assert "using torch's ops" in caplog.text


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units of the last place, for same-sign finite values of one low-precision dtype."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return (a.view(bits).int() - b.view(bits).int()).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_add_rms_norm_matches_torch(native_kernels: native.NativeKernels, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(576, generator=gen)).to(dtype)
    want_h = h + delta
    want = rms_norm(want_h, weight, 1e-5)
    got_h = h.clone()
    got = native_kernels.add_rms_norm(got_h, delta, weight, 1e-5)
    assert torch.equal(got_h, want_h)  # the residual sum, in place, rounded exactly like torch's add
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:  # same rounding steps; only the float32 sum of squares runs in another order, which can move
        # the rounded normalised value by an ulp, and so the product with the weight by at most two
        ulps = _ulps_apart(got, want)
        assert ulps.max().item() <= 2 and (ulps == 0).float().mean().item() > 0.99
    no_delta = native_kernels.add_rms_norm(want_h.clone(), None, weight, 1e-5)
    torch.testing.assert_close(no_delta, got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_matches_torch(native_kernels: native.NativeKernels, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(9, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow and zeros
    want = silu_and_mul(gate_up)
    got = native_kernels.silu_and_mul(gate_up)
    assert got.shape == want.shape and not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # silu rounded before it multiplies up, as in torch; exp differs from torch's by an ulp at most
        assert (got.float() - want.float()).abs().max().item() <= (want.float().abs() * 2**-6).max().item()
        assert (got == want).float().mean().item() > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_and_cache_matches_torch_bit_for_bit(native_kernels: native.NativeKernels, dtype: torch.dtype) -> None:
    """Rotated Q/K equal apply_rotary's exactly (same rounding steps), and K/V land in their slots."""
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    tokens = 11
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim, 4096, torch.device("cpu"))
    cos, sin = rotary.tables(positions, dtype)  # [tokens, 1, head_dim]
    slots = torch.randperm(8 * block, generator=gen)[:tokens]
    k_cache = torch.zeros(8, block, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    got = native_kernels.rotary_and_cache(
        qkv, cos.view(tokens, -1), sin.view(tokens, -1), k_cache, v_cache, slots, heads, kv_heads
    )
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    want = apply_rotary(qk, cos, sin)  # [tokens, heads + kv_heads, head_dim]
    assert torch.equal(got, want)
    k_want, v_want = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv(
        want[:, heads:], qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim), k_want, v_want, slots
    )
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native_kernels.rotary_and_cache(
            qkv,
            cos.view(tokens, -1),
            sin.view(tokens, -1),
            k_cache,
            v_cache,
            torch.full((tokens,), 8 * block),
            heads,
            kv_heads,
        )


def test_small_ops_give_the_same_bits_on_one_thread_and_split(native_kernels: native.NativeKernels) -> None:
    """A decode step's few rows run on the calling thread, a prefill's many rows split over the threads: the same
    rows give the same bits either way (400 rows split; the same rows 50 at a time run inline)."""
    gen = torch.Generator().manual_seed(8)
    rows, chunk, dtype = 400, 50, torch.bfloat16
    h = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(576, generator=gen)).to(dtype)
    split_h = h.clone()
    split = native_kernels.add_rms_norm(split_h, delta, weight, 1e-5)
    pieces = [(h[i : i + chunk].clone(), delta[i : i + chunk]) for i in range(0, rows, chunk)]
    inline = torch.cat([native_kernels.add_rms_norm(p, d, weight, 1e-5) for p, d in pieces])
    assert torch.equal(split, inline) and torch.equal(split_h, torch.cat([p for p, _ in pieces]))
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
    assert torch.equal(
        native_kernels.silu_and_mul(gate_up),
        torch.cat([native_kernels.silu_and_mul(gate_up[i : i + chunk]) for i in range(0, rows, chunk)]),
    )
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim, 4096, torch.device("cpu"))
    cos, sin = (t.view(rows, -1) for t in rotary.tables(torch.randint(0, 4000, (rows,), generator=gen), dtype))
    slots = torch.randperm(32 * block, generator=gen)[:rows]
    caches = [torch.zeros(32, block, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    split_qk = native_kernels.rotary_and_cache(qkv, cos, sin, caches[0], caches[1], slots, heads, kv_heads)
    inline_qk = torch.cat(
        [
            native_kernels.rotary_and_cache(
                qkv[i : i + chunk],
                cos[i : i + chunk],
                sin[i : i + chunk],
                caches[2],
                caches[3],
                slots[i : i + chunk],
                heads,
                kv_heads,
            )
            for i in range(0, rows, chunk)
        ]
    )
    assert torch.equal(split_qk, inline_qk)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
