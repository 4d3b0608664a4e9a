"""Async (pipelined) batching gives exactly the tokens of the synchronous path, in every mode."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import LLM, ConfigError, SamplingParams
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.runtime.async_mode import DeviceInfo, resolve_async_batching
from helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: Any) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-llama-async"))
    build_tiny_model("llama", folder)
    return folder


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


PARAMS = {
    "greedy": lambda i: SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    "seeded": lambda i: SamplingParams(max_tokens=20, temperature=0.9, seed=100 + i, ignore_eos=True),
    "mixed": lambda i: [
        SamplingParams(max_tokens=5 + 3 * (i % 6), temperature=0.0),
        SamplingParams(max_tokens=18, temperature=1.3, top_k=20, seed=i, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, top_p=0.8, seed=7 * i),
        SamplingParams(max_tokens=16, temperature=0.5, top_k=5, top_p=0.9, seed=3, stop_token_ids=[17, 99]),
    ][i % 4],
    # history-dependent processors (penalties), min-p, logit bias and n > 1 (forked blocks, copy-on-write)
    "penalties+n": lambda i: [
        SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(
            max_tokens=14,
            temperature=0.9,
            seed=i,
            presence_penalty=1.0,
            frequency_penalty=0.5,
            min_p=0.05,
            ignore_eos=True,
        ),
        SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=i, frequency_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logit_bias={3: 2.0}, min_tokens=4, logprobs=2),
    ][i % 4],
}
PRESSURE = {
    "none": dict(block_size=4, max_model_len=128, kv_cache_memory=2**20),
    "preemption": dict(block_size=4, max_model_len=96, kv_cache_memory=26 * 4 * 512, max_num_seqs=12),
    "chunked": dict(block_size=4, max_model_len=128, kv_cache_memory=2**20, max_num_batched_tokens=12),
    "both": dict(block_size=4, max_model_len=96, kv_cache_memory=28 * 4 * 512, max_num_batched_tokens=16),
}


def _run(folder: str, async_batching: bool, pressure: str, params: str) -> tuple[list[list[int]], Any]:
    llm = LLM(model=folder, async_batching=async_batching, **PRESSURE[pressure])
    assert llm.engine.async_batching is async_batching
    prompts = _prompts(14, seed=len(params) + len(pressure))
    outs = llm.generate(prompts, [PARAMS[params](i) for i in range(len(prompts))], use_tqdm=False)
    stats = llm.engine.stats()
    assert (llm.engine.runner.num_placeholder_tokens > 0) is async_batching
    llm.engine.check_idle()
    llm.engine.close()
    return [
        [
            (c.token_ids, c.finish_reason, None if c.logprobs is None else [lp.logprob for lp in c.logprobs])
            for c in o.outputs
        ]
        for o in outs
    ], stats


def _assert_same(a: list[Any], b: list[Any]) -> None:
    """Identical tokens and finish reasons; logprobs equal to 1e-5 (preemption happens at other
    steps in the two modes, so recomputed KV comes from differently shaped batches)."""
    assert [[c[:2] for c in o] for o in a] == [[c[:2] for c in o] for o in b]
    for oa, ob in zip(a, b):
        for ca, cb in zip(oa, ob):
            assert (ca[2] is None) == (cb[2] is None)
            if ca[2] is not None:
                assert max(abs(x - y) for x, y in zip(ca[2], cb[2])) < 1e-5


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("pressure", list(PRESSURE))
def test_async_matches_sync(tiny_llama: str, pressure: str, params: str) -> None:
    sync_tokens, sync_stats = _run(tiny_llama, False, pressure, params)
    async_tokens, async_stats = _run(tiny_llama, True, pressure, params)
    _assert_same(async_tokens, sync_tokens)
    for stats in (sync_stats, async_stats):
        if pressure in ("preemption", "both"):
            assert stats.num_preemptions > 0, "the small cache was meant to force preemption"
        if pressure in ("chunked", "both"):
            assert stats.num_partial_prefills > 0, "the small budget was meant to force chunked prefill"


def test_default_model_async_matches_sync_under_preemption() -> None:
    prompts = [[1] + [(97 * i + 31 * j) % 40000 + 50 for j in range(20 + 9 * i)] for i in range(8)]
    params = [
        SamplingParams(max_tokens=24, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True) for i in range(8)
    ]
    results = []
    for async_batching in (False, True):
        llm = LLM(
            async_batching=async_batching,
            dtype="float32",
            max_model_len=160,
            kv_cache_memory=11 * 16 * 46080,
            max_num_batched_tokens=48,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_partial_prefills > 0
        llm.engine.check_idle()
        llm.engine.close()
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]


def test_auto_picks_the_pipeline_on_cpu_and_true_works(tiny_llama: str) -> None:
    assert LLM(model=tiny_llama, kv_cache_memory=2**20, max_model_len=64).engine.async_batching is True
    assert (
        LLM(model=tiny_llama, kv_cache_memory=2**20, max_model_len=64, async_batching=True).engine.async_batching
        is True
    )
    assert (
        LLM(model=tiny_llama, kv_cache_memory=2**20, max_model_len=64, async_batching=False).engine.async_batching
        is False
    )


def test_explicit_true_on_a_device_without_a_pipeline_is_a_clear_error() -> None:
    no_pipeline = DeviceInfo(torch.device("meta"), has_streams=False, name="meta device")
    with pytest.raises(ConfigError) as info:
        resolve_async_batching(True, no_pipeline)
    message = str(info.value)
    assert "'meta'" in message and "async_batching='auto'" in message and "async_batching=False" in message
    assert "requires CUDA" not in message
    assert resolve_async_batching("auto", no_pipeline) is False


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_first_token_comes_out_of_the_step_that_sampled_it(tiny_llama: str, max_tokens: int) -> None:
    """Overlap must not delay time to first token: the step() that runs a request's prefill returns
    its first token, in async mode as in sync mode (later tokens may trail by one step). With
    max_tokens=1 the request also finishes there, while a next step is already prepared for it."""
    calls_until_first = {}
    for async_batching in (False, True):
        llm = LLM(model=tiny_llama, kv_cache_memory=2**20, max_model_len=128, async_batching=async_batching)
        engine = llm.engine
        engine.add_request([3, 4, 5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        calls, first = 0, None
        while engine.has_work():
            calls += 1
            outs = engine.step()
            if first is None and any(o.outputs[0].token_ids for o in outs):
                first = calls
                assert len(outs[0].outputs[0].token_ids) == 1
                assert outs[0].finished == (max_tokens == 1)
        calls_until_first[async_batching] = first
        engine.check_idle()
    assert calls_until_first[True] == calls_until_first[False] == 1


def test_output_sink_gets_host_thread_commits_during_the_forward(tiny_llama: str) -> None:
    """With a sink, outputs the host thread commits leave at once, from that thread; together with
    what step() returns they are the same stream as the synchronous path, one terminal each."""
    import threading

    prompts = _prompts(4, seed=11)
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    ref = LLM(model=tiny_llama, kv_cache_memory=2**20, max_model_len=128, async_batching=False)
    expected = {str(i): o.outputs[0].token_ids for i, o in enumerate(ref.generate(prompts, params, use_tqdm=False))}
    engine = LLM(model=tiny_llama, kv_cache_memory=2**20, max_model_len=128, async_batching=True).engine
    delivered: list[tuple[str, Any]] = []
    engine.output_sink = lambda outs: delivered.extend((threading.current_thread().name, o) for o in outs)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, str(i))
    while engine.has_work():
        delivered.extend((threading.current_thread().name, o) for o in engine.step())
    assert any(name.startswith("conveyor-host") for name, _ in delivered)
    last: dict[str, list[int]] = {}
    finished = []
    for _, out in delivered:
        tokens = out.outputs[0].token_ids
        assert tokens[: len(last.get(out.request_id, []))] == last.get(out.request_id, [])  # in order
        last[out.request_id] = tokens
        if out.finished:
            finished.append(out.request_id)
    assert sorted(finished) == sorted(expected) and last == expected
    engine.check_idle()


def test_stop_found_one_step_late_is_discarded(tiny_llama: str) -> None:
    """With async on, a request whose token ends it has already been planned one step further;
    that extra token must never reach the output."""
    prompt = _prompts(1, seed=5)[0]
    probe = LLM(model=tiny_llama, kv_cache_memory=2**20, max_model_len=128, async_batching=False)
    ref = (
        probe.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    stop_at = ref[5]
    expected = ref[: ref.index(stop_at) + 1]
    llm = LLM(model=tiny_llama, kv_cache_memory=2**20, max_model_len=128, async_batching=True)
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]), "r")
    seen: list[list[int]] = []
    while engine.has_work():
        seen.extend(o.outputs[0].token_ids for o in engine.step())
    assert seen[-1] == expected and all(len(s) <= len(expected) for s in seen)
    engine.check_idle()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_abort_storm_ends_every_request_exactly_once(tiny_llama: str, data: Any) -> None:
    engine = _storm_engine(tiny_llama, data.draw(st.booleans(), label="async"))
    n = data.draw(st.integers(1, 10), label="requests")
    terminal: dict[str, int] = {}
    live: list[str] = []
    for i in range(n):
        prompt = [data.draw(st.integers(2, 511)) for _ in range(data.draw(st.integers(1, 40)))]
        params = SamplingParams(
            max_tokens=data.draw(st.integers(1, 12)), temperature=data.draw(st.sampled_from([0.0, 1.0])), seed=i
        )
        live.append(engine.add_request(prompt, params, f"req{i}"))
    steps = 0
    while engine.has_work():
        steps += 1
        assert steps < 500, "the engine did not drain"
        if live and data.draw(st.integers(0, 3), label="abort?") == 0:
            victim = data.draw(st.sampled_from(sorted(live)), label="victim")
            for out in engine.abort(victim):
                assert out.finished and out.outputs[0].finish_reason == "abort"
                terminal[out.request_id] = terminal.get(out.request_id, 0) + 1
        for out in engine.step():
            if out.finished:
                terminal[out.request_id] = terminal.get(out.request_id, 0) + 1
        live = [r for r in live if r not in terminal]
    assert sorted(terminal) == sorted(f"req{i}" for i in range(n))
    assert set(terminal.values()) == {1}, terminal
    engine.check_idle()
    assert engine.blocks.num_held_blocks == 0
    engine.close()


def _storm_engine(folder: str, async_batching: bool) -> Engine:
    return Engine(
        EngineConfig(
            model=folder,
            async_batching=async_batching,
            block_size=4,
            max_model_len=64,
            kv_cache_memory=30 * 4 * 512,
            max_num_batched_tokens=20,
        )
    )


def test_calling_the_engine_during_a_step_is_refused_by_name(tiny_llama: str) -> None:
    """The scheduler belongs to the step's host turn while it runs: an abort from the output sink (the
    host thread) is refused with a clear error instead of racing it; between steps it works."""
    engine = LLM(model=tiny_llama, kv_cache_memory=2**20, max_model_len=128, async_batching=True).engine
    errors: list[str] = []

    def sink(outs: list[Any]) -> None:
        try:
            engine.abort([o.request_id for o in outs])
        except RuntimeError as exc:
            errors.append(str(exc))
        delivered.extend(outs)

    delivered: list[Any] = []
    engine.output_sink = sink
    for i, prompt in enumerate(_prompts(3, seed=4)):
        engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), str(i))
    while engine.has_work():
        delivered.extend(engine.step())
    assert errors and all("while a step is running" in e for e in errors)
    assert sorted(o.request_id for o in delivered if o.finished) == ["0", "1", "2"]  # each ended once, normally
    engine.check_idle()


def test_a_slow_engine_thread_never_runs_a_step_whose_masks_need_the_next_turn(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU overlap: the engine thread runs the forwards queued before the host turn began (and those the
    turn waits for). A step the turn itself submits may wait for grammar masks that only the next turn can
    make; had the engine thread counted it (because it started serving after the turn had submitted),
    its forward would wait for masks nobody makes this turn. Delay the engine thread each turn so the
    host turn always submits first, and check constrained async output equals the synchronous one."""
    import time as time_module

    import conveyor.model.runner as runner_module
    from conveyor.runtime.cpu_overlap import CpuOverlapExecutor
    from helpers.structured_schemas import save_small_tokenizer

    folder = str(tmp_path / "tiny-tok")
    build_tiny_model("llama", folder, vocab_size=520, eos_token_id=1, bos_token_id=0)
    save_small_tokenizer(folder)
    monkeypatch.setattr(runner_module, "GRAMMAR_WAIT_S", 30.0)  # a deadlock fails in seconds, not minutes
    serve = CpuOverlapExecutor.serve

    def late_serve(self: CpuOverlapExecutor, until: Any, owed: int) -> None:
        time_module.sleep(0.02)  # the host turn schedules and submits before this thread looks at the queue
        serve(self, until, owed)

    monkeypatch.setattr(CpuOverlapExecutor, "serve", late_serve)
    prompts = _prompts(6, seed=21)
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, structured_outputs={"regex": r"[a-z]{1,8}!"}),
        SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True),
    ] * 3
    options = dict(block_size=4, max_model_len=96, kv_cache_memory=2**20, max_num_batched_tokens=16)
    results = {}
    for async_batching in (False, True):
        llm = LLM(model=folder, async_batching=async_batching, **options)
        results[async_batching] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.check_idle()
    assert results[True] == results[False]
