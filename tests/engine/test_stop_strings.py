"""Stop strings over a real tokenizer: the engine's incremental search against plain string ops."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.core.kv_cache import BlockManager
from conveyor.core.plan import StepResult
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerLimits
from conveyor.engine.output import OutputProcessor
from conveyor.params import SamplingParams

TEXT = "Hello world, this is a test of stop strings. Ünïcödé café — 東京タワー 🚀 done."


@pytest.fixture(scope="module")
def tokenizer(default_llm: Any) -> Any:
    return default_llm.get_tokenizer()


def _stream(tokenizer: Any, text: str, params: SamplingParams) -> tuple[Any, list[str]]:
    """Feed the tokens of `text` as if the model sampled them; return the final output and the
    texts shown after each step."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    scheduler = Scheduler(SchedulerLimits(4, 64, 4096), BlockManager(64, 16))
    outputs = OutputProcessor(scheduler, tokenizer, eos_token_ids=(2,))
    request = Request("r", [1, 2, 3], params.clone(max_tokens=len(ids)), seed=0, arrival_index=0, max_model_len=4096)
    scheduler.add(request)
    outputs.track("r", None, [request])
    shown, final, i = [], None, 0
    while scheduler.has_work():
        plan = scheduler.schedule()
        result = StepResult(plan.step_id, [ids[i]] * len(plan.sampling_seqs))
        i += len(plan.sampling_seqs)
        for out in outputs.commit(plan, result):
            shown.append(out.outputs[0].text)
            final = out
    return final, shown


def _expected(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    hits = [(full.find(s), s) for s in stops if full.find(s) >= 0]
    if not hits:
        return full, None
    index, stop = min(hits)
    return full[: index + (len(stop) if include else 0)], stop


CASES = {
    "across a token boundary": ["o w"],
    "inside one token": ["world"],
    "at the very first token": ["Hello"],
    "long, from the start (held-back text must never shrink)": ["Hello world, this is"],
    "first character only": ["H"],
    "overlapping, earlier start wins": ["s a t", "is a"],
    "overlapping, same start": ["stop strings", "stop"],
    "never reached": ["xyz123"],
    "unicode (multi-byte, split bytes)": ["東京"],
    "accented": ["café"],
    "emoji": ["🚀"],
    "at the very end": ["done."],
}


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_stop_string_table(tokenizer: Any, case: str, include: bool) -> None:
    stops = CASES[case]
    out, shown = _stream(
        tokenizer, TEXT, SamplingParams(temperature=0.0, stop=stops, include_stop_str_in_output=include)
    )
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    full = tokenizer.decode(ids, skip_special_tokens=True)
    text, stop = _expected(full, stops, include)
    completion = out.outputs[0]
    assert completion.text == text
    assert completion.stop_reason == stop
    assert completion.finish_reason == ("stop" if stop else "length")
    for partial in shown:  # streamed text only grows, and never shows a stop string that gets cut
        assert text.startswith(partial) or partial == text
        if not include and stop is not None:
            assert stop not in partial


def test_stop_strings_ignored_before_min_tokens(tokenizer: Any) -> None:
    out, _ = _stream(tokenizer, TEXT, SamplingParams(temperature=0.0, stop=["Hello", "test"], min_tokens=3))
    full = tokenizer.decode(tokenizer(TEXT, add_special_tokens=False).input_ids)
    assert out.outputs[0].text == full[: full.find("test")] and out.outputs[0].stop_reason == "test"


@pytest.mark.parametrize("min_tokens, stops", [(2, True), (3, False)])
def test_a_stop_string_must_end_after_the_first_min_tokens_minus_one_tokens(
    tokenizer: Any, min_tokens: int, stops: bool
) -> None:
    """Text made before min_tokens cannot stop a request by itself (the answer would be cut to nothing);
    a match that ends in a later token counts, even when it begins earlier."""
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    before = tokenizer.decode(ids[: min_tokens - 1])  # the text no match may end inside
    stop = "world"
    assert TEXT.count(stop) == 1
    ends = TEXT.find(stop) + len(stop)
    assert stops == (ends > len(before))
    out, _ = _stream(tokenizer, TEXT, SamplingParams(temperature=0.0, stop=[stop], min_tokens=min_tokens))
    full = tokenizer.decode(ids)
    if stops:
        assert out.outputs[0].text == full[: full.find(stop)] and out.outputs[0].stop_reason == stop
    else:
        assert out.outputs[0].text == full and out.outputs[0].finish_reason == "length"
