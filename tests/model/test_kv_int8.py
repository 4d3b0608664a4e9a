"""The int8 KV cache (kv_cache_dtype='int8', conveyor/model/kv_int8.py): the torch reference's rounding rule, the
native kernels that write and read it against that reference, and the engine on it: the native kernels against the
torch path token for token, async against sync, and its error against the exact cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conveyor import LLM, SamplingParams
from conveyor.errors import ConfigError
from conveyor.model import kv_int8
from conveyor.model.attention import AttentionBatch, PrefillChunk, paged_attention
from conveyor.model.layers import apply_rotary
from helpers.tiny_models import build_tiny_model


def test_rows_read_back_within_half_a_step_of_their_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10  # rows of many magnitudes
    x[7, 1] = 0.0  # a row of zeros: codes 0, scale 0
    codes, scales = kv_int8.quantize_rows(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (50, 3)
    back = codes.float() * scales.unsqueeze(-1)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all((back - x).abs() <= amax / 254 * (1 + 1e-5))
    assert torch.all(codes[7, 1] == 0) and scales[7, 1] == 0
    assert int(codes.abs().max()) == 127  # every row's largest value takes the full range
    assert torch.equal(codes.abs().amax(-1)[scales > 0], torch.full_like(scales[scales > 0], 127, dtype=torch.int8))


@pytest.mark.parametrize("keys", [False, True])
def test_rows_land_in_their_block_pages(keys: bool) -> None:
    """write_rows puts token t's row in its block's page at position t % block_size (a V page row by row, a K page
    dimension by dimension) and its scale after the codes; read_blocks gives them back in the plain cache's
    layout."""
    block_size, kv_heads, head_dim, num_blocks = 4, 2, 8, 5
    cache = torch.zeros(kv_int8.cache_shape(num_blocks, block_size, kv_heads, head_dim), dtype=torch.int8)
    x = torch.randn(3, kv_heads, head_dim)
    slots = torch.tensor([9, 2, 19])  # blocks 2, 0, 4
    kv_int8.write_rows(x, cache, slots, keys)
    codes, scales = kv_int8.quantize_rows(x)
    page = cache[2, 1]  # block 2, KV head 1: slot 9 is its position 1
    stored = page[1::block_size][:head_dim] if keys else page[head_dim : 2 * head_dim]
    assert torch.equal(stored, codes[0, 1])
    assert page[block_size * head_dim :].view(torch.float32)[1] == scales[0, 1]
    back = kv_int8.read_blocks(cache, torch.tensor([4, 0]), head_dim, torch.float32, keys)  # [2, block_size, kvh, d]
    assert torch.equal(back[0, 3], codes[2].float() * scales[2].unsqueeze(-1))
    assert torch.equal(back[1, 2], codes[1].float() * scales[1].unsqueeze(-1))
    assert torch.all(back[1, 0] == 0)  # never written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rotary_write_gives_the_torch_references_bytes(native_kernels: Any, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim, block_size, num_blocks = 37, 9, 3, 64, 16, 8
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)  # [tokens, head_dim]
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    shape = kv_int8.cache_shape(num_blocks, block_size, kv_heads, head_dim)
    k_native, v_native = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    qk = native_kernels.rotary_and_cache(qkv, cos, sin, k_native, v_native, slots, heads, kv_heads)
    rows = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    rotated = apply_rotary(rows[:, : heads + kv_heads], cos[:, None], sin[:, None])  # [tokens, heads + kvh, d]
    assert torch.equal(qk, rotated)
    k_ref, v_ref = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    kv_int8.write_rows(rotated[:, heads:], k_ref, slots, keys=True)
    kv_int8.write_rows(rows[:, heads + kv_heads :], v_ref, slots, keys=False)
    assert torch.equal(k_native, k_ref) and torch.equal(v_native, v_ref)


def _filled_caches(
    gen: torch.Generator, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    caches = []
    for keys in (True, False):
        cache = torch.zeros(kv_int8.cache_shape(num_blocks, block_size, kv_heads, head_dim), dtype=torch.int8)
        rows = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen) * 2
        kv_int8.write_rows(rows, cache, torch.arange(num_blocks * block_size), keys)
        caches.append(cache)
    return caches[0], caches[1]  # K, V


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per sequence: attention in float64 over the read-back rows of its first ctx tokens."""
    head_dim = q.shape[-1]
    out = []
    for i in range(q.shape[0]):
        ctx = int(lens[i])
        k = kv_int8.read_blocks(k_cache, tables[i], head_dim, torch.float64, keys=True)  # [blocks, bs, kvh, d]
        v = kv_int8.read_blocks(v_cache, tables[i], head_dim, torch.float64, keys=False)  # [blocks, bs, kvh, d]
        k, v = (x.flatten(0, 1)[:ctx].transpose(0, 1) for x in (k, v))  # [kvh, ctx, d] each
        o = F.scaled_dot_product_attention(
            q[i].double()[:, None, :], k, v, scale=scale, enable_gqa=k.shape[0] != q.shape[1]
        )
        out.append(o[:, 0])
    return torch.stack(out)  # [seqs, heads, d]


# head_dim 64 and 128 with groups up to 8 take the AVX-512 path, head_dim 16 and a group of 9 the portable one.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (8, 1, 128), (4, 2, 16), (9, 1, 64)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_native_decode_attention_matches_float64_over_the_read_back_rows(
    native_kernels: Any, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    num_blocks = 90
    k_cache, v_cache = _filled_caches(gen, num_blocks, block_size, kv_heads, head_dim)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 37, 2, 5 * block_size])  # [seqs]
    max_blocks = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in range(len(lens))])
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    got = native_kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    exact = _reference(q, k_cache, v_cache, tables, lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2  # float32 sums; bfloat16: the output's rounding
    torch.testing.assert_close(got.double(), exact, atol=tolerance, rtol=tolerance)


def test_native_decode_attention_refuses_a_page_that_does_not_fit_head_dim(native_kernels: Any) -> None:
    q = torch.randn(1, 4, 64)
    cache = torch.zeros(3, 2, 16 * 66, dtype=torch.int8)  # pages of head_dim 62, not 64
    with pytest.raises(RuntimeError, match=r"int8 caches must be \[num_blocks, kv_heads, block_size \* \(head_dim"):
        native_kernels.decode_attention(
            q, cache, cache, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0.125
        )


def test_native_prefill_reads_the_int8_pages_as_the_torch_path_does(native_kernels: Any) -> None:
    """Prompt chunks (one fresh, one behind cached tokens) through the native prefill kernel against the torch
    path (read-back rows rounded to bfloat16, SDPA), over the same int8 cache."""
    if not native_kernels.prefill_attention_available():
        pytest.skip("the native prefill kernel needs AMX-BF16")
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 16, 40
    k_cache, v_cache = _filled_caches(gen, num_blocks, block_size, kv_heads, head_dim)
    chunks = [(0, 45, 45, [3, 7, 1]), (45, 20, 70, [9, 2, 30, 11, 5])]  # (first row, rows, context, blocks)
    tokens = sum(n for _, n, _, _ in chunks)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(torch.bfloat16)
    slots = torch.cat(
        [
            torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)])
            for _, n, ctx, blocks in chunks
        ]
    )
    width = max(len(b) for *_, b in chunks)

    def batch(native: bool) -> AttentionBatch:
        prefills = [PrefillChunk(row, n, ctx, torch.tensor(blocks), native=native) for row, n, ctx, blocks in chunks]
        return AttentionBatch(
            slot_mapping=slots,
            decode_groups=[],
            prefills=prefills,
            prefill_spans=torch.tensor([[row, n, ctx] for row, n, ctx, _ in chunks]),
            prefill_tables=torch.tensor([b + [0] * (width - len(b)) for *_, b in chunks]),
        )

    k_new = torch.empty(tokens, kv_heads, head_dim, dtype=torch.bfloat16)  # unused: the rows are in the cache
    scale = head_dim**-0.5
    native = paged_attention(
        q,
        k_new,
        k_new,
        k_cache,
        v_cache,
        batch(True),
        scale,
        kv_written=True,
        prefill_op=native_kernels.prefill_attention,
    )
    reference = paged_attention(q, k_new, k_new, k_cache, v_cache, batch(False), scale, kv_written=True)
    torch.testing.assert_close(native.float(), reference.float(), atol=2e-2, rtol=2e-2)
    assert (native.float() - reference.float()).abs().mean() < 2e-3


def _tiny(tmp_path: Path, head_dim: int) -> str:
    folder = str(tmp_path / f"tiny{head_dim}")
    build_tiny_model("llama", folder, hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2)
    return folder


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 20) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch,head_dim", [("llama", 64), ("llama", 16), ("gemma2", 16), ("gemma3", 16)])
def test_engine_on_int8_gives_the_torch_paths_tokens(
    tmp_path: Path, native_kernels: Any, arch: str, head_dim: int
) -> None:
    """float32 compute, so that the two backends differ only by float32 rounding: the native kernels (rotary
    write, decode attention on the AVX-512 or the portable path) against the torch reference, token for token,
    with prompts that span blocks and share a prefix (cached blocks read back). Gemma 2 / 3: sliding windows and
    soft caps, whose layers read the int8 cache through the torch path on both backends."""
    if arch == "llama":
        folder = _tiny(tmp_path, head_dim)
    else:
        folder = str(tmp_path / arch)
        build_tiny_model(arch, folder)
    rng = np.random.default_rng(7)
    shared = rng.integers(2, 512, size=40).tolist()
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (3, 17, 33, 70)] + [[*shared, 5, 9], [*shared, 7]]
    outs = {}
    for backend in ("torch", "native"):
        llm = LLM(
            model=folder,
            kernels=backend,
            dtype="float32",
            kv_cache_dtype="int8",
            async_batching=False,
            kv_cache_memory="8MiB",
            max_model_len=256,
        )
        outs[backend] = _greedy(llm, prompts)
        llm.engine.check_idle()
    assert outs["native"] == outs["torch"]


def test_engine_on_int8_async_gives_the_sync_tokens_and_the_decode_stack_the_loops(
    tmp_path: Path, native_kernels: Any
) -> None:
    """bfloat16 on the native kernels (native prefill where AMX is, the decode stack): async batching against
    sync, and the decode stack against the Python layer loop, token for token."""
    folder = _tiny(tmp_path, 64)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (5, 19, 40, 64, 90, 12)]
    outs = {}
    for mode in (False, True):
        llm = LLM(
            model=folder,
            kernels="native",
            dtype="bfloat16",
            kv_cache_dtype="int8",
            async_batching=mode,
            kv_cache_memory="8MiB",
            max_model_len=256,
        )
        outs[mode] = _greedy(llm, prompts)
    assert outs[True] == outs[False]
    model = llm.engine.runner.model
    if model.decode_stack is not None:
        model.decode_stack = None
        llm.engine.reset_prefix_cache()
        assert _greedy(llm, prompts) == outs[True]


def test_int8_cache_costs_no_more_accuracy_than_bfloat16_compute(tmp_path: Path) -> None:
    """The next-token log-probabilities after three prompts (the prefill reads the int8 cache back), float32 with
    the int8 cache against float32 with the exact one: they move less than bfloat16 compute (with an exact cache)
    moves them. (The tiny random model is sensitive: bfloat16 alone moves some by over a nat.)"""
    folder = _tiny(tmp_path, 64)
    rng = np.random.default_rng(13)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (20, 45, 80)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=20)
    tops = {}
    for name, options in {
        "exact": dict(dtype="float32"),
        "int8": dict(dtype="float32", kv_cache_dtype="int8"),
        "bfloat16": dict(dtype="bfloat16"),
    }.items():
        llm = LLM(model=folder, kv_cache_memory="8MiB", max_model_len=256, **options)
        tops[name] = [dict(o.outputs[0].logprobs[0].top) for o in llm.generate(prompts, params, use_tqdm=False)]

    def moved(name: str) -> float:  # mean over prompts of the largest change among the top tokens both keep
        changes = []
        for exact, other in zip(tops["exact"], tops[name]):
            shared = set(exact) & set(other)
            assert len(shared) >= 10
            changes.append(max(abs(exact[t] - other[t]) for t in shared))
        return sum(changes) / len(changes)

    assert 0 < moved("int8") <= moved("bfloat16")


def test_int8_cache_takes_half_the_bytes_per_token_and_is_refused_on_cuda(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, 16)
    sizes = {}
    for cache in ("auto", "int8"):
        llm = LLM(model=folder, dtype="bfloat16", kv_cache_dtype=cache, kv_cache_memory="4MiB", max_model_len=128)
        plan = llm.engine.runner.cache_plan
        sizes[cache] = plan.bytes_per_block
    assert sizes["int8"] == 2 * 2 * 2 * 16 * (16 + 4)  # K and V, 2 layers, 2 KV heads, 16 tokens, 16 codes + scale
    assert sizes["auto"] == 2 * 2 * 2 * 16 * 16 * 2
    with pytest.raises(ConfigError, match="kv_cache_dtype='int8' runs on CPU only"):
        LLM(model=folder, device="cuda", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8' is not supported; choose one of auto, int8"):
        LLM(model=folder, kv_cache_dtype="fp8")
