"""The sampler flags each row whose logits hold NaN or +inf (SampleOutput.finite), on every sampling path, and the
runner reports those rows as NONFINITE_TOKEN; -inf (a mask) is never an error."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conveyor.core.plan import NONFINITE_TOKEN
from conveyor.model.layers import Projection, pack_bf16_tiles
from conveyor.model.runner import reported
from conveyor.model.sampler import PenaltyTensors, SampleOutput, SamplingTensors, finite_rows, sample
from conveyor.structured.bitmask import bitmask_words

ROWS, VOCAB = 6, 300
BROKEN = {1: "nan", 2: "inf", 4: "nan everywhere"}
"""Rows of the test logits that are not finite; row 3 holds -inf entries only (a mask), rows 0 and 5 are plain."""


def _logits(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(ROWS, VOCAB, generator=g) * 3
    logits[1, 250] = float("nan")  # far from the row's largest value: only an argmax that ranks NaN first sees it
    logits[2, 7] = float("inf")
    logits[3, :100] = float("-inf")
    logits[4] = float("nan")
    return logits.to(dtype)


def _expected() -> list[bool]:
    return [row not in BROKEN for row in range(ROWS)]


def _tensors(temperature: float, **extra: Any) -> SamplingTensors:
    random_rows = temperature > 0
    return SamplingTensors(
        temperature=torch.full((ROWS,), temperature),
        top_k=torch.full((ROWS,), 20, dtype=torch.int64),
        top_p=torch.full((ROWS,), 0.9),
        seeds=torch.arange(ROWS, dtype=torch.int64),
        output_index=torch.zeros(ROWS, dtype=torch.int64),
        all_greedy=not random_rows,
        any_top_k_or_p=random_rows,
        **extra,
    )


def _check(out: SampleOutput) -> None:
    assert out.finite is not None and out.finite.dtype == torch.bool
    assert out.finite.tolist() == _expected()


def test_finite_rows_reads_the_value_at_the_argmax() -> None:
    logits = _logits()
    _check(SampleOutput(logits.max(dim=-1).indices, finite=finite_rows(logits, logits.max(dim=-1).indices)))
    assert finite_rows(torch.full((1, 4), float("-inf")), torch.zeros(1, dtype=torch.int64)).tolist() == [True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_rows(dtype: torch.dtype) -> None:
    _check(sample(_logits(dtype), _tensors(0.0)))


@pytest.mark.parametrize("kind", ["sampled", "penalties", "bias", "logprobs"])
def test_processed_rows(kind: str) -> None:
    extra: dict[str, Any] = {}
    if kind == "penalties":
        rows = torch.arange(ROWS, dtype=torch.int64)
        output = torch.ones(ROWS, dtype=torch.bool)
        extra["penalties"] = PenaltyTensors(
            rows, rows + 3, output, torch.ones(ROWS), torch.ones(ROWS), torch.full((ROWS,), 1.3)
        )
    if kind == "bias":
        extra["bias"] = (torch.tensor([0, 1]), torch.tensor([5, 5]), torch.tensor([2.0, -3.0]))
    if kind == "logprobs":
        extra["num_logprobs"] = 2
    out = sample(_logits(), _tensors(0.0 if kind != "sampled" else 0.8, **extra))
    _check(out)
    if kind == "logprobs":
        assert out.logprob is not None and torch.isfinite(out.logprob[[0, 3, 5]]).all()


def _allow_all_but(masked: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grammar masks for every row: all tokens allowed but `masked`."""
    bits = torch.zeros(ROWS, bitmask_words(VOCAB) * 32, dtype=torch.bool)
    bits[:, :VOCAB] = True
    bits[:, masked] = False
    words = bits.view(ROWS, -1, 32).to(torch.int64) << torch.arange(32)
    packed = words.sum(dim=-1).to(torch.int64)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # [rows, words]
    return torch.arange(ROWS, dtype=torch.int64), packed


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_grammar_rows(native: bool, temperature: float, request: pytest.FixtureRequest) -> None:
    """A NaN the grammar allows is an error. One it forbids: the native kernel writes -inf over it (no error:
    nothing can draw it), torch's mask adds -inf, which leaves NaN (an error, as the argmax would draw it)."""
    kernels = request.getfixturevalue("native_kernels") if native else None
    logits = _logits()
    out = sample(logits.clone(), _tensors(temperature), _allow_all_but(250), kernels, logits_owned=True)
    expected = _expected()
    expected[1] = native  # row 1's NaN is at token 250, which the grammar forbids
    assert out.finite is not None and out.finite.tolist() == expected
    whole = sample(logits.clone(), _tensors(temperature), _allow_all_but(3), kernels, logits_owned=True)
    assert whole.finite is not None and whole.finite.tolist()[4] is False  # a row all NaN, on every kernel


def test_native_argmax_flags_the_same_rows(native_kernels: Any) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        _check(sample(_logits(dtype), _tensors(0.0), kernels=native_kernels))
        _check(sample(_logits(dtype), _tensors(0.8), kernels=native_kernels))


def test_reported_ids_carry_the_flag_in_the_ids() -> None:
    out = SampleOutput(torch.tensor([4, 0, 9]), finite=torch.tensor([True, False, True]))
    shown = reported(out)
    assert shown.tokens.tolist() == [4, NONFINITE_TOKEN, 9] and shown.finite is None
    assert out.tokens.tolist() == [4, 0, 9]  # the ids the next step's placeholders read stay valid
    plain = SampleOutput(torch.tensor([1]))
    assert reported(plain) is plain


def test_weight_rows_reads_the_amx_tiles_in_place() -> None:
    """The LM head's rows at the fused argmax, read from its AMX tile layout (pack_bf16_tiles, no AMX needed to
    pack) and from a plain weight."""
    weight = torch.randn(100, 64).bfloat16()
    index = torch.tensor([0, 5, 15, 16, 17, 99, 31])
    projection = Projection(weight.float())
    assert torch.equal(projection.weight_rows(index), weight.float()[index])
    projection.tiles = pack_bf16_tiles(weight)  # as Projection packs a bfloat16 head where AMX is there
    assert torch.equal(projection.weight_rows(index), weight[index])
