"""Structured output: every finished output follows its grammar, async batching gives the tokens of the
synchronous path, and bad constraints are refused by name."""

from __future__ import annotations

import json
import random
import re
import threading
from typing import Any

import jsonschema
import pytest
import torch

from conveyor import LLM, InvalidRequestError, SamplingParams
from conveyor.structured.bitmask import DeferredBitmask, apply_bitmask, bitmask_words
from helpers.structured_schemas import random_object, save_small_tokenizer
from helpers.tiny_models import build_tiny_model

MODEL_VOCAB = 520
"""The tiny model's vocabulary (its LM head) is wider than its tokenizer's 500 tokens, as real models
pad theirs: masks must cover the model's width, the 20 ids past the tokenizer always forbidden."""


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory: Any) -> str:
    """A 2-layer random model with a small real BPE tokenizer, so grammars compile against a real
    vocabulary while steps stay cheap (the default model's 49,152-token vocabulary is covered by
    the server tests)."""
    folder = str(tmp_path_factory.mktemp("tiny-structured"))
    build_tiny_model("llama", folder, vocab_size=MODEL_VOCAB, eos_token_id=1, bos_token_id=0)
    save_small_tokenizer(folder)
    return folder


def test_bitmask_sets_exactly_the_forbidden_tokens_to_minus_inf() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 100, 5
    words = bitmask_words(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(batch, vocab, generator=gen)
    rows = torch.tensor([0, 2, 4])
    out = apply_bitmask(logits, rows, bitmask)
    for b in range(batch):
        for t in range(vocab):
            if b in (1, 3):
                assert out[b, t] == logits[b, t]
                continue
            bit = (int(bitmask[[0, 2, 4].index(b), t // 32]) >> (t % 32)) & 1
            assert out[b, t] == (logits[b, t] if bit else float("-inf"))
    every = apply_bitmask(logits[[0, 2, 4]], torch.arange(3), bitmask)  # all rows constrained: the fast branch
    assert torch.equal(every, out[[0, 2, 4]])


def test_a_deferred_mask_filler_runs_once_on_the_thread_that_waits() -> None:
    """set_filler (CPU: the host hands over the grammar states) leaves the computing to the sampling thread."""
    deferred = DeferredBitmask([0, 2])
    mask = torch.full((2, bitmask_words(64)), 7, dtype=torch.int32)
    ran_on: list[int] = []

    def fill() -> torch.Tensor:
        ran_on.append(threading.get_ident())
        return mask

    host = threading.Thread(target=deferred.set_filler, args=(fill,))
    host.start()
    host.join()
    assert deferred.is_set and ran_on == []
    assert deferred.wait(timeout_s=5) is mask
    assert ran_on == [threading.get_ident()]


def _valid(schema: dict[str, Any], text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_200_random_schemas_greedy_and_seeded_give_valid_json(tiny_with_tokenizer: str) -> None:
    rng = random.Random(19)
    schemas = [random_object(rng) for _ in range(200)]
    llm = LLM(model=tiny_with_tokenizer, max_model_len=256, kv_cache_memory="64MiB", max_num_seqs=400)
    params = [SamplingParams(max_tokens=48, temperature=0.0, structured_outputs={"json": s}) for s in schemas]
    params += [
        SamplingParams(max_tokens=48, temperature=0.8, seed=i, structured_outputs={"json": json.dumps(s)})
        for i, s in enumerate(schemas)
    ]
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    finished = length = 0
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), (c.finish_reason, out.error)
        if c.finish_reason == "length":
            length += 1
            continue
        finished += 1
        schema = p.structured_outputs.schema
        assert _valid(schema, c.text), (schema, c.text)
    print(f"\n200 schemas x (greedy, seeded): {finished} finished and valid, {length} cut by max_tokens")
    assert finished >= len(params) // 2  # most finish: a test where nothing finished would check nothing
    llm.engine.check_idle()


REGEXES = [
    r"[0-9]{3}-[a-z]{2,4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{0,5} [0-9]+",
    r"\d+\.\d\d",
    r"(ab|cd)*e",
    r"[a-f0-9]{8}",
]


def test_regex_and_choice_outputs_match(tiny_with_tokenizer: str) -> None:
    llm = LLM(model=tiny_with_tokenizer, max_model_len=128, kv_cache_memory="32MiB")
    choices = [["Paris", "London", "Rome"], ["a b c", "ab", "a"], ["ja", "nein"]]
    params = [
        SamplingParams(max_tokens=24, temperature=t, seed=i, structured_outputs={"regex": r})
        for i, r in enumerate(REGEXES)
        for t in (0.0, 1.0)
    ]
    params += [
        SamplingParams(max_tokens=24, temperature=t, seed=i, n=2, structured_outputs={"choice": c})
        for i, c in enumerate(choices)
        for t in (0.0, 1.0)
    ]
    params += [SamplingParams(max_tokens=24, temperature=1.0, seed=5, guided_regex=r"[xyz]{2}")]
    outs = llm.generate(["Say:"] * len(params), params, use_tqdm=False)
    finished = 0
    for out, p in zip(outs, params):
        spec = p.structured_outputs
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                continue
            finished += 1
            if spec.regex is not None:
                assert re.fullmatch(spec.regex, c.text), (spec.regex, c.text)
            else:
                assert c.text in spec.choice, (spec.choice, c.text)
    assert finished >= 20
    llm.engine.check_idle()


def _mixed_params(i: int) -> SamplingParams:
    schema = {
        "type": "object",
        "properties": {
            "k": {"type": "string", "maxLength": 6},
            "v": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        },
        "required": ["k", "v"],
        "additionalProperties": False,
    }
    return [
        SamplingParams(max_tokens=30, temperature=0.0, structured_outputs={"json": schema}),
        SamplingParams(max_tokens=18, temperature=0.9, seed=i, ignore_eos=True),
        SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=i, structured_outputs={"regex": r"[a-z]{1,12}!"}),
        SamplingParams(
            max_tokens=20,
            temperature=0.7,
            seed=2 * i,
            structured_outputs={"json_object": True},
            stop=["}"],
            presence_penalty=0.5,
        ),
        SamplingParams(max_tokens=4, temperature=0.0, structured_outputs={"choice": ["alpha", "beta"]}, logprobs=1),
        SamplingParams(max_tokens=3, temperature=0.0, structured_outputs={"json": schema}),
    ][i % 6]


PRESSURE = {
    "preemption+chunked": dict(block_size=4, max_model_len=96, kv_cache_memory=30 * 4 * 512, max_num_batched_tokens=16),
    "plain": dict(block_size=4, max_model_len=128, kv_cache_memory=2**21),
}


def _run_mixed(
    folder: str, async_batching: bool, pressure: str, masks_when_sampled: bool = True
) -> tuple[list[Any], Any]:
    llm = LLM(model=folder, async_batching=async_batching, **PRESSURE[pressure])
    assert llm.engine.grammars.masks_when_sampled  # on a CPU the sampling thread makes a step's masks
    llm.engine.grammars.masks_when_sampled = masks_when_sampled
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))] for _ in range(14)]
    params = [_mixed_params(i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert (llm.engine.runner.num_placeholder_tokens > 0) is async_batching
    llm.engine.check_idle()
    llm.engine.close()
    for out, p in zip(outs, params):  # every finished constrained output follows its grammar
        spec = p.structured_outputs
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length"), (c.finish_reason, out.error)
            if spec is None or c.finish_reason != "stop" or c.stop_reason is not None:
                continue
            if spec.schema is not None:
                assert _valid(spec.schema, c.text), c.text
            elif spec.regex is not None:
                assert re.fullmatch(spec.regex, c.text), c.text
            else:
                assert c.text in spec.choice
        if p.max_tokens == 3 and spec is not None:  # cut short: "length", never a claim of validity
            assert out.outputs[0].finish_reason == "length" and not _valid(spec.schema, out.outputs[0].text)
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs], stats


@pytest.mark.parametrize("pressure", list(PRESSURE))
def test_async_equals_sync_for_mixed_constrained_batch(tiny_with_tokenizer: str, pressure: str) -> None:
    sync, sync_stats = _run_mixed(tiny_with_tokenizer, False, pressure)
    overlapped, async_stats = _run_mixed(tiny_with_tokenizer, True, pressure)
    assert overlapped == sync
    if pressure != "plain":
        assert sync_stats.num_preemptions > 0 and async_stats.num_preemptions > 0
        assert sync_stats.num_partial_prefills > 0 and async_stats.num_partial_prefills > 0


def test_masks_made_on_the_host_thread_during_the_forward_give_the_same_tokens(tiny_with_tokenizer: str) -> None:
    """The CUDA arrangement (the host thread makes step N+1's masks while step N computes), run on the CPU
    with async batching, gives the tokens of the CPU's own (masks made by the sampling thread), synchronous."""
    sync, _ = _run_mixed(tiny_with_tokenizer, False, "preemption+chunked")
    on_host, stats = _run_mixed(tiny_with_tokenizer, True, "preemption+chunked", masks_when_sampled=False)
    assert on_host == sync and stats.num_preemptions > 0


def test_bad_constraints_are_refused_by_name(tiny_with_tokenizer: str) -> None:
    llm = LLM(model=tiny_with_tokenizer, max_model_len=64, kv_cache_memory="8MiB")
    cases = [
        ({"json": {"type": "objekt"}}, "JSON schema cannot be compiled"),
        ({"regex": "(unclosed"}, "regex cannot be compiled"),
        ({"grammar": "start: undefined_rule"}, "grammar cannot be compiled"),
        ({"json": "[1, 2"}, "not valid JSON"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ]
    for constraint, words in cases:
        with pytest.raises(InvalidRequestError, match="structured_outputs") as info:
            llm.generate("x", SamplingParams(structured_outputs=constraint), use_tqdm=False)
        assert words in str(info.value)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    llm.engine.check_idle()
    slow = LLM(model=tiny_with_tokenizer, max_model_len=64, kv_cache_memory="8MiB", structured_output_timeout=1e-6)
    big = {
        "type": "object",
        "properties": {f"p{i}": {"enum": [f"value-{i}-{j}" for j in range(200)]} for i in range(30)},
    }  # takes milliseconds, not a microsecond
    with pytest.raises(InvalidRequestError, match="took longer than"):
        slow.generate("x", SamplingParams(structured_outputs={"json": big}), use_tqdm=False)


def test_abort_of_a_constrained_request_mid_flight(tiny_with_tokenizer: str) -> None:
    llm = LLM(model=tiny_with_tokenizer, max_model_len=128, kv_cache_memory="8MiB")
    engine = llm.engine
    keep = engine.add_request(
        "x", SamplingParams(max_tokens=40, temperature=1.0, seed=1, structured_outputs={"regex": "[a-z]{30}"})
    )
    gone = engine.add_request(
        "y", SamplingParams(max_tokens=40, temperature=1.0, seed=2, structured_outputs={"regex": "[a-z]{30}"})
    )
    finals: list[Any] = []
    for i in range(80):
        if not engine.has_work():
            break
        finals += [out for out in engine.step() if out.finished]
        if i == 2:
            finals += engine.abort(gone)
    assert sorted(out.request_id for out in finals) == sorted([keep, gone])  # one terminal output each
    by_id = {out.request_id: out.outputs[0] for out in finals}
    assert by_id[gone].finish_reason == "abort"
    assert by_id[keep].finish_reason == "stop" and re.fullmatch("[a-z]{30}", by_id[keep].text)
    engine.check_idle()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_bitmask_kernel_matches_torch(native_kernels: Any, dtype: torch.dtype) -> None:
    """csrc/token_bitmask.cpp against the torch path: a vocabulary that is not a multiple of 32, a subset of
    rows, all-allowed and all-forbidden words; in a copy unless the caller owns the logits."""
    gen = torch.Generator().manual_seed(3)
    vocab, batch = 1000, 6
    words = bitmask_words(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32, generator=gen)
    bitmask[0, :5] = -1  # every token allowed
    bitmask[1, 3:9] = 0  # every token forbidden
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    rows = torch.tensor([5, 0, 2, 3])
    reference = apply_bitmask(logits, rows, bitmask)
    before = logits.clone()
    copied = apply_bitmask(logits, rows, bitmask, native=native_kernels.apply_token_bitmask_)
    assert torch.equal(logits, before)  # not owned: the input is left alone
    assert torch.equal(copied, reference)
    owned = logits.clone()
    assert apply_bitmask(owned, rows, bitmask, native=native_kernels.apply_token_bitmask_, owned=True) is owned
    assert torch.equal(owned, reference)
    with pytest.raises(RuntimeError, match="too few"):
        native_kernels.apply_token_bitmask_(logits.clone(), rows, bitmask[:, :10].contiguous())
    with pytest.raises(RuntimeError, match="outside"):
        native_kernels.apply_token_bitmask_(logits.clone(), torch.tensor([0, 1, 2, 9]), bitmask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [False, True])
def test_greedy_grammar_rows_masked_in_the_model_dtype_pick_the_float32_ids(
    native_kernels: Any, dtype: torch.dtype, native: bool
) -> None:
    """A plain greedy batch with grammar rows is masked in the model's dtype (in place when the caller owns the
    logits): the ids equal the float32 path's (the same batch with logprobs asked), ties and all-forbidden rows
    included, and logits the caller still owns are left alone."""
    from conveyor.model.sampler import SamplingTensors, sample

    gen = torch.Generator().manual_seed(5)
    rows, vocab = 8, 1000
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)  # coarse bfloat16 values: ties
    logits[1, 7] = logits[1, 900] = logits[1].max() + 1  # a tie at the top; token 7 forbidden below
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    bitmask[0] = -1  # all allowed
    bitmask[2] = 0  # all forbidden
    bitmask[1, 0] &= ~(1 << 7)
    grammar = (torch.tensor([6, 1, 3, 0, 4]), bitmask)
    greedy = SamplingTensors(
        temperature=torch.zeros(rows),
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows),
        seeds=torch.zeros(rows, dtype=torch.int64),
        output_index=torch.zeros(rows, dtype=torch.int64),
        all_greedy=True,
        any_top_k_or_p=False,
    )
    kernel = native_kernels if native else None
    before = logits.clone()
    got = sample(logits, greedy, grammar, kernel).tokens
    assert torch.equal(logits, before)
    owned = logits.clone()
    assert torch.equal(sample(owned, greedy, grammar, kernel, logits_owned=True).tokens, got)
    greedy.num_logprobs = 1  # the float32 path
    reference = sample(logits, greedy, grammar, kernel).tokens
    assert torch.equal(got, reference) and torch.equal(logits, before)
    assert got[1] == 900  # the forbidden first maximum lost to the allowed one
    allowed = ((bitmask[1, got[1] // 32] >> (got[1] % 32)) & 1) == 1
    assert allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_argmax_allowed_is_the_argmax_of_the_masked_logits(native_kernels: Any, dtype: torch.dtype) -> None:
    """csrc/token_bitmask.cpp's argmax_allowed against torch's argmax of the masked logits, row by row: dense,
    sparse, single-token, all-forbidden and all-allowed masks, a vocabulary that is not a multiple of 32 (bits
    past it set), more words than needed, ties (coarse values) and a forbidden maximum."""
    gen = torch.Generator().manual_seed(11)
    vocab, batch = 1000, 9
    words = bitmask_words(vocab) + 1  # one spare word, all bits set: past the vocabulary, never a token
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)  # [batch, vocab]
    logits[2, 40] = logits[2, 999] = logits[2].max() + 1  # a tie at the top, both allowed: 40 wins
    bitmask = torch.randint(-(2**31), 2**31 - 1, (7, words), dtype=torch.int32, generator=gen)  # dense
    bitmask[:, -2:] = -1  # the bits of the last partial word past the vocabulary, and the spare word
    bitmask[1] = 0
    bitmask[1, 5] = 1 << 3  # one token: 163
    bitmask[3] = 0  # none: 0, as the argmax of a row of -inf
    bitmask[4] = -1  # all allowed
    sparse = torch.rand(vocab, generator=gen) < 0.01
    bitmask[5] = 0
    for t in sparse.nonzero().flatten().tolist():
        bitmask[5, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    top = int(logits[6].float().argmax())
    bitmask[6, top // 32] &= ~torch.tensor(1 << (top % 32)).to(torch.int32)  # the row's maximum forbidden
    bitmask[0] = -1
    bitmask[0, 1] = 0  # tokens 32..63 forbidden, the tie row's 40 among them: 999 wins
    rows = torch.tensor([2, 8, 0, 4, 7, 1, 6])
    got = native_kernels.argmax_allowed(logits, rows, bitmask)
    reference = apply_bitmask(logits.float(), rows, bitmask).argmax(dim=-1)[rows]
    assert torch.equal(got, reference), (got, reference)
    assert got[0] == 999 and got[1] == 163 and got[3] == 0 and got[6] != top
    with pytest.raises(RuntimeError, match="outside"):
        native_kernels.argmax_allowed(logits, torch.tensor([0, 1, 2, 3, 4, 5, 9]), bitmask)
