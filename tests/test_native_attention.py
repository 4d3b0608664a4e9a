"""The native decode-attention kernel against a float64 reference, on every code path it has."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import build_tiny_model
from conveyor import LLM
from conveyor.errors import ConfigError
from conveyor.model import native
from conveyor.model.native import NativeUnavailable, load_decode_attention, resolve_decode_attention


@pytest.fixture(scope="module")
def kernel() -> native.DecodeAttention:
    try:
        return load_decode_attention()
    except NativeUnavailable as exc:
        if "needs" in str(exc) or "Linux only" in str(exc):  # no compiler here: nothing to test
            pytest.skip(str(exc))
        raise


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               lens: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
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


# head_dim 64 and 128 with groups 1..8 take the AVX-512 path (where the CPU has it); 8 and
# group 9 take the portable one; float16 always the portable one.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 1, 128), (6, 2, 8), (9, 1, 64)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_kernel_matches_float64_reference(kernel: native.DecodeAttention, dtype: torch.dtype, heads: int,
                                          kv_heads: int, head_dim: int, block_size: int) -> None:
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
    scale = head_dim ** -0.5
    got = kernel(q, k_cache, v_cache, tables, lens, scale)
    exact = _reference(q, k_cache, v_cache, tables, lens, scale, torch.float64)
    same_dtype = _reference(q, k_cache, v_cache, tables, lens, scale, dtype)  # SDPA in the same dtype
    err = (got.double() - exact).abs().max().item()
    sdpa_err = (same_dtype.double() - exact).abs().max().item()
    assert got.shape == q.shape and got.dtype == dtype
    # no less exact than torch's own SDPA in this dtype (float32: ~1e-7; bfloat16: ~1e-2)
    assert err <= max(2 * sdpa_err, 1e-6), (err, sdpa_err)


def test_kernel_rejects_bad_inputs_with_reasons(kernel: native.DecodeAttention) -> None:
    cache = torch.zeros(4, 4, 2, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(torch.zeros(1, 2, 8, dtype=torch.float64), cache, cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        kernel(torch.zeros(1, 2, 8), cache, cache, tables.int(), lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        kernel(torch.zeros(1, 3, 8), cache, cache, tables, lens, 1.0)


def test_loading_the_kernel_leaves_denormals_alone(kernel: native.DecodeAttention) -> None:
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
            llm = LLM(model=folder, attention_backend=backend, async_batching=False, dtype="float32")
        except ConfigError as exc:
            pytest.skip(str(exc))
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["native"] == outs["torch"]


def test_backend_choice_errors_and_fallback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="attention_backend='bogus' is not supported"):
        LLM(attention_backend="bogus")
    with pytest.raises(ConfigError, match="cannot run on cuda"):
        resolve_decode_attention("native", torch.device("cuda"))
    assert resolve_decode_attention("auto", torch.device("cuda")) is None
    assert resolve_decode_attention("torch", torch.device("cpu")) is None

    def unavailable() -> None:
        raise NativeUnavailable("building the native attention kernel needs c++ on PATH (install g++)")

    monkeypatch.setattr(native, "load_decode_attention", unavailable)
    with pytest.raises(ConfigError, match="needs c\\+\\+ on PATH .*attention_backend='auto'"):
        resolve_decode_attention("native", torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="conveyor.model.native"):
        assert resolve_decode_attention("auto", torch.device("cpu")) is None
    assert "using the torch reference" in caplog.text
