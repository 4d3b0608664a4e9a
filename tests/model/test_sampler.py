"""conveyor.model.sampler: top-k / top-p against transformers, greedy rows, the sampled
distribution (chi-square), counter-based determinism, and the noise itself."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from conveyor.model.sampler import SamplingTensors, apply_top_k_top_p, uniform_noise
from conveyor.model.sampler import sample as sample_output


def sample_tokens(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    return sample_output(logits, t).tokens


try:
    from scipy.stats import chi2 as _scipy_chi2
except ImportError:  # scipy is optional here
    _scipy_chi2 = None


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): scipy when present, else the regularized
    upper incomplete gamma function Q(df/2, statistic/2), which is that survival function."""
    if _scipy_chi2 is not None:
        return float(_scipy_chi2.sf(statistic, df))
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def test_chi2_sf_helper() -> None:
    # Closed forms: df=2 -> exp(-x/2); df=1 -> erfc(sqrt(x/2)).
    for x in (0.5, 3.0, 13.8):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    assert chi2_sf(30.58, 15) == pytest.approx(0.01, rel=2e-3)  # textbook table: chi2(15) 99th percentile


def tensors(
    temperature: Sequence[float] | torch.Tensor,
    top_k: Sequence[int] | torch.Tensor,
    top_p: Sequence[float] | torch.Tensor,
    seeds: Sequence[int] | torch.Tensor,
    output_index: Sequence[int] | torch.Tensor,
) -> SamplingTensors:
    """SamplingTensors for a batch, one entry per row (as the model runner would build them)."""
    t = torch.as_tensor(temperature, dtype=torch.float32)
    k = torch.as_tensor(top_k, dtype=torch.int64)
    p = torch.as_tensor(top_p, dtype=torch.float32)
    return SamplingTensors(
        temperature=t,
        top_k=k,
        top_p=p,
        seeds=torch.as_tensor(seeds, dtype=torch.int64),
        output_index=torch.as_tensor(output_index, dtype=torch.int64),
        all_greedy=bool((t == 0).all()),
        any_top_k_or_p=bool((k > 0).any() or (p < 1).any()),
    )


def hf_reference(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """transformers' TopK then TopP warpers, one row at a time with that row's settings."""
    rows = []
    for row, k, p in zip(logits, top_k, top_p):
        x = row.unsqueeze(0).clone()
        if k > 0:
            x = TopKLogitsWarper(top_k=k)(None, x)
        if p < 1.0:
            x = TopPLogitsWarper(top_p=p)(None, x)
        rows.append(x[0])
    return torch.stack(rows)


# ---- (a) top-k / top-p ----------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [7, 50, 300])
def test_top_k_top_p_matches_transformers(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 96
    logits = torch.randn(rows, vocab, generator=g) * 3
    ks = torch.randint(0, vocab + 5, (rows,), generator=g)  # 0 = off; > vocab = everything
    ks[::7] = -1  # also off
    ps = torch.rand(rows, generator=g) * 0.97 + 0.02
    ps[::5] = 1.0  # off
    ps[3::11] = 0.999
    ps[4::13] = 1e-9  # 1 - p rounds to 1.0 in float32: only the always-kept top token survives
    ks_list, ps_list = ks.tolist(), ps.tolist()
    got = apply_top_k_top_p(logits, ks, ps)
    want = hf_reference(logits, ks_list, ps_list)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "different tokens were filtered"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    kept = torch.isfinite(got).sum(dim=1)
    assert (kept >= 1).all()
    assert (kept < vocab).any() and (kept == vocab).any()  # the filters did bite, and not always


def test_top_k_keeps_ties_with_the_kth_largest() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0], [5.0, 5.0, 5.0, 1.0, 1.0, 1.0]])
    ks = [2, 1]
    got = apply_top_k_top_p(logits, torch.tensor(ks), torch.ones(2))
    assert torch.equal(got, hf_reference(logits, ks, [1.0, 1.0]))
    assert torch.isfinite(got).sum(dim=1).tolist() == [2, 3]


@pytest.mark.parametrize("top_p", [0.125, 0.25, 0.5, 0.75])
def test_top_p_boundary_is_inclusive_like_transformers(top_p: float) -> None:
    # Uniform logits over 8 tokens: probabilities and their partial sums are exact in float32,
    # so 1 - top_p equals a partial sum and the "<=" of transformers decides.
    logits = torch.zeros(1, 8)
    got = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([top_p]))
    want = hf_reference(logits, [0], [top_p])
    assert int(torch.isfinite(got).sum()) == int(torch.isfinite(want).sum()) == round(8 * top_p)


# ---- (b) greedy rows ----------------------------------------------------------------------


def test_greedy_rows_are_exact_argmax_in_a_mixed_batch() -> None:
    g = torch.Generator().manual_seed(1)
    rows, vocab = 64, 1000
    logits = torch.randn(rows, vocab, generator=g)
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.5
    temperature[::2] = 0.0
    t = tensors(temperature, [40] * rows, [0.8] * rows, list(range(rows)), [3] * rows)
    got = sample_tokens(logits, t)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(got[::2], argmax[::2])
    assert not torch.equal(got[1::2], argmax[1::2])  # the sampled rows really sampled
    all_greedy = tensors([0.0] * rows, [0] * rows, [1.0] * rows, list(range(rows)), [3] * rows)
    assert torch.equal(sample_tokens(logits, all_greedy), argmax)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_greedy_in_the_model_dtype_picks_the_float32_ids(dtype: torch.dtype) -> None:
    """A batch of plain greedy rows is argmaxed in the model's dtype; the ids must be those of the
    float32 path (sampling with logprobs asked widens first), ties included: the first maximum wins."""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 16, 4099
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)  # coarse values: many ties
    logits[3, 10] = logits[3, 2000] = logits[3].max() + 1  # an exact tie at the top
    logits[5] = 0.5  # a constant row
    greedy = tensors([0.0] * rows, [0] * rows, [1.0] * rows, list(range(rows)), [0] * rows)
    got = sample_output(logits, greedy)
    widened = logits.float()
    reference = torch.tensor([int(torch.nonzero(r == r.max())[0]) for r in widened])  # first index of the max
    assert torch.equal(got.tokens, reference)
    assert got.tokens[3] == 10 and got.tokens[5] == 0
    greedy.num_logprobs = 2  # the float32 path
    with_logprobs = sample_output(logits, greedy)
    assert torch.equal(with_logprobs.tokens, reference)
    assert with_logprobs.top_logprobs is not None and with_logprobs.top_logprobs.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_argmax_rows_is_torchs_max_indices(native_kernels: Any, dtype: torch.dtype) -> None:
    """csrc/argmax_rows.cpp against torch's max(dim=-1).indices on every vector tail length, exact ties (the first
    wins), NaN (torch picks the first NaN), +-inf, an all -inf row, and rows with a stride (a view of wider rows)."""
    g = torch.Generator().manual_seed(11)
    for vocab in (1, 2, 15, 16, 17, 63, 64, 65, 127, 4099, 49152):
        rows = 9
        logits = (torch.randn(rows, vocab, generator=g) * 3).round().to(dtype)  # coarse values: many ties
        if vocab > 2:
            logits[1, vocab // 2] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie at the top, far apart
            logits[2, vocab - 1] = float("nan")
            logits[3, vocab // 3] = logits[3, vocab - 2] = float("nan")
            logits[4, vocab - 1] = float("inf")
            logits[5, 0] = float("-inf")
        logits[6] = float("-inf")
        logits[7] = 0.25
        got = native_kernels.argmax_rows(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.max(dim=-1).indices), vocab
        wide = torch.randn(rows, vocab + 5, generator=g).to(dtype)
        view = wide[:, 2 : vocab + 2]  # rows vocab + 5 apart
        assert torch.equal(native_kernels.argmax_rows(view), view.max(dim=-1).indices), vocab
    assert native_kernels.argmax_rows(torch.empty(0, 10, dtype=dtype)).shape == (0,)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        native_kernels.argmax_rows(torch.randn(4, 6).to(dtype).t())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native_kernels.argmax_rows(torch.randn(4, 6, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampling_with_the_native_argmax_gives_torchs_ids(native_kernels: Any, dtype: torch.dtype) -> None:
    """sample() with the native kernels (every argmax through argmax_rows) against sample() on torch's ops: plain
    greedy in the model's dtype, and a mixed batch of greedy and top-k/top-p sampled rows (float32 path)."""
    g = torch.Generator().manual_seed(5)
    rows, vocab = 64, 49152
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[9, 100] = logits[9, 30000] = logits[9].max() + 1
    greedy = tensors([0.0] * rows, [0] * rows, [1.0] * rows, list(range(rows)), [0] * rows)
    assert torch.equal(
        sample_output(logits, greedy, kernels=native_kernels).tokens, sample_output(logits, greedy).tokens
    )
    temperature = torch.rand(rows, generator=g) + 0.5
    temperature[::3] = 0.0
    mixed = tensors(temperature, [50] * rows, [0.9] * rows, list(range(rows)), [4] * rows)
    native = sample_output(logits, mixed, kernels=native_kernels).tokens
    assert torch.equal(native, sample_output(logits, mixed).tokens)
    assert torch.equal(native[::3], logits[::3].float().argmax(dim=-1))


# ---- (c) the sampled distribution -------------------------------------------------------


def draw_counts(
    logits: torch.Tensor, temperature: float, n: int, top_k: int = 0, top_p: float = 1.0, vary: str = "index"
) -> torch.Tensor:
    """Counts of n samples from one row of logits; draws differ by output index (or by seed)."""
    vocab = logits.shape[-1]
    idx = torch.arange(n, dtype=torch.int64)
    seeds = idx * 7919 + 17 if vary == "seed" else torch.full((n,), 1234, dtype=torch.int64)
    index = torch.zeros(n, dtype=torch.int64) if vary == "seed" else idx
    t = tensors(torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p), seeds, index)
    tokens = sample_tokens(logits.expand(n, vocab).contiguous(), t)
    return torch.bincount(tokens, minlength=vocab)


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit over the tokens that can be produced (probs > 0).

    Tokens expected fewer than 5 times are pooled into one bin, as the chi-square
    approximation asks."""
    n = counts.sum().item()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token that has probability zero"
    expected = probs[support].double() * n
    observed = counts[support].double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
        observed = torch.cat([observed[~small], observed[small].sum().unsqueeze(0)])
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    return chi2_sf(statistic, len(expected) - 1)


ALPHA = 1e-3  # the sampler is deterministic, so this is a fixed pass/fail, not a flaky one
N_DRAWS = 20_000


@pytest.mark.parametrize("vary", ["index", "seed"])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_sampled_frequencies_match_softmax(temperature: float, vary: str) -> None:
    logits = torch.randn(12, generator=torch.Generator().manual_seed(5)) * 1.5
    counts = draw_counts(logits, temperature, N_DRAWS, vary=vary)
    right = torch.softmax(logits / temperature, dim=-1)
    wrong = torch.softmax(logits / (2 * temperature), dim=-1)
    assert chi2_p_value(counts, right) > ALPHA
    assert chi2_p_value(counts, wrong) < ALPHA  # the test has the power to reject a wrong law


def test_sampled_frequencies_match_the_filtered_distribution() -> None:
    logits = torch.randn(16, generator=torch.Generator().manual_seed(9)) * 1.2
    temperature, k, p = 0.8, 9, 0.85
    filtered = hf_reference((logits / temperature).unsqueeze(0), [k], [p])[0]
    right = torch.softmax(filtered, dim=-1)
    assert 1 < int((right > 0).sum()) < 9  # top-p cut deeper than top-k here
    counts = draw_counts(logits, temperature, N_DRAWS, top_k=k, top_p=p)
    assert chi2_p_value(counts, right) > ALPHA
    # Top-k alone (top-p ignored) is a different law, and the test tells them apart.
    top_k_only = torch.softmax(hf_reference((logits / temperature).unsqueeze(0), [k], [1.0])[0], dim=-1)
    assert chi2_p_value(counts, top_k_only) < ALPHA


# ---- (d) determinism ------------------------------------------------------------------------


def test_a_rows_sample_depends_only_on_seed_and_output_index() -> None:
    g = torch.Generator().manual_seed(3)
    rows, vocab = 32, 500
    logits = torch.randn(rows, vocab, generator=g) * 2
    temperature = (torch.rand(rows, generator=g) + 0.5).tolist()
    top_k = torch.randint(0, 60, (rows,), generator=g).tolist()
    top_p = (torch.rand(rows, generator=g) * 0.5 + 0.5).tolist()
    seeds = torch.randint(0, 2**62, (rows,), generator=g).tolist()
    index = torch.randint(0, 1000, (rows,), generator=g).tolist()
    base = sample_tokens(logits, tensors(temperature, top_k, top_p, seeds, index))

    # Shuffled, and mixed with unrelated rows (greedy ones among them).
    perm = torch.randperm(rows, generator=g).tolist()
    extra = 20
    other = torch.randn(extra, vocab, generator=g)
    mixed_logits = torch.cat([logits[perm], other])
    mixed = sample_tokens(
        mixed_logits,
        tensors(
            [temperature[i] for i in perm] + [0.0] * (extra // 2) + [1.3] * (extra // 2),
            [top_k[i] for i in perm] + [5] * extra,
            [top_p[i] for i in perm] + [0.5] * extra,
            [seeds[i] for i in perm] + list(range(extra)),
            [index[i] for i in perm] + [0] * extra,
        ),
    )
    assert mixed[:rows].tolist() == [base[i].item() for i in perm]

    for i in (0, 7, 31):  # alone in its batch
        alone = sample_tokens(
            logits[i : i + 1], tensors([temperature[i]], [top_k[i]], [top_p[i]], [seeds[i]], [index[i]])
        )
        assert alone.item() == base[i].item()


def test_draws_change_with_output_index_and_seed() -> None:
    logits = torch.zeros(1, 64)  # uniform: every draw is decided by the noise alone

    def draw(seed: int, index: int) -> int:
        return sample_tokens(logits, tensors([1.0], [0], [1.0], [seed], [index])).item()

    by_index = {draw(42, i) for i in range(200)}
    by_seed = {draw(s, 0) for s in range(200)}
    assert len(by_index) > 40 and len(by_seed) > 40
    assert [draw(42, i) for i in range(20)] == [draw(42, i) for i in range(20)]


# ---- (e) the noise ------------------------------------------------------------------------


def test_uniform_noise_range_shape_and_streams() -> None:
    seeds = torch.tensor([0, 1, 2**32, 2**62 + 5, 2**63 - 1], dtype=torch.int64)
    index = torch.zeros(5, dtype=torch.int64)
    u = uniform_noise(seeds, index, 4096)
    assert u.shape == (5, 4096) and u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    # Different seeds (including ones differing only above bit 32) give different streams.
    for a in range(5):
        for b in range(a + 1, 5):
            assert (u[a] == u[b]).float().mean() < 0.01, (seeds[a], seeds[b])
    # Same (seed, index) -> same noise; another index -> another stream.
    assert torch.equal(u, uniform_noise(seeds, index, 4096))
    assert (u != uniform_noise(seeds, index + 1, 4096)).float().mean() > 0.99
    # Roughly uniform: 16 equal bins.
    counts = torch.histc(u.flatten(), bins=16, min=0, max=1)
    assert chi2_p_value(counts.long(), torch.full((16,), 1 / 16)) > ALPHA
    assert abs(u.mean().item() - 0.5) < 0.01


# Regression: the noise was once ((bits >> 8) + 0.5) / 2**24 in float32, where the top value
# rounded to exactly 1.0, so -log(-log(u)) = +inf forced a token even past top-k/top-p.


# A search over seeds and output indices found that seed 7 reaches the top noise value
# within its first 64 output indices at a vocabulary of 8192 (64 x 8192 = 2**19 values; the
# chance per value is 2**-24, so a blind search needs ~2**24 values and seconds of CPU).
EXTREME_SEED, EXTREME_VOCAB, EXTREME_ROWS = 7, 8192, 64


def extreme_noise_sample() -> torch.Tensor:
    seeds = torch.full((EXTREME_ROWS,), EXTREME_SEED, dtype=torch.int64)
    return uniform_noise(seeds, torch.arange(EXTREME_ROWS), EXTREME_VOCAB)  # [rows, vocab]


def test_uniform_noise_stays_below_one_on_a_large_sample() -> None:
    u = extreme_noise_sample()
    assert bool((u > 0).all())
    assert bool((u < 1).all()), f"uniform_noise returned {u.max().item()}"


# ---- (f) top_k = 1 ------------------------------------------------------------------------


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    g = torch.Generator().manual_seed(11)
    rows, vocab = 256, 300
    logits = torch.randn(rows, vocab, generator=g) * 2
    temperature = (torch.rand(rows, generator=g) * 3 + 0.05).tolist()
    seeds, index = list(range(rows)), list(range(rows))
    argmax = logits.argmax(dim=-1)
    assert torch.equal(sample_tokens(logits, tensors(temperature, [1] * rows, [1.0] * rows, seeds, index)), argmax)
    for tiny in (1e-6, 1e-9):
        assert torch.equal(sample_tokens(logits, tensors(temperature, [0] * rows, [tiny] * rows, seeds, index)), argmax)
    # Without the filter the same rows do not all pick the argmax: the check above can fail.
    assert not torch.equal(sample_tokens(logits, tensors(temperature, [0] * rows, [1.0] * rows, seeds, index)), argmax)


def test_top_k_1_equals_greedy_even_where_the_noise_is_extreme() -> None:
    # Check top_k=1 on every row of the extreme sample (one of them holds the top noise value).
    vocab = EXTREME_VOCAB
    logits = torch.linspace(0, 10, vocab).expand(EXTREME_ROWS, vocab).contiguous()  # argmax: last token
    rows = EXTREME_ROWS
    got = sample_tokens(
        logits, tensors([1.0] * rows, [1] * rows, [1.0] * rows, [EXTREME_SEED] * rows, list(range(rows)))
    )
    assert got.tolist() == [vocab - 1] * rows, f"top_k=1 sampled {sorted(set(got.tolist()))}, not only the argmax"
