"""The always-on step timeline the engine view reads: a bounded ring, filled by every step."""

from __future__ import annotations

import itertools
import random
import threading
from typing import Any

import pytest

from conveyor import LLM, SamplingParams
from conveyor.runtime.timeline import DEVICE_LANE, HOST_LANE, StepTimeline
from helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: Any) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-llama-timeline"))
    build_tiny_model("llama", folder)
    return folder


def test_ring_keeps_the_newest_spans_and_filters_by_end_time() -> None:
    timeline = StepTimeline(capacity=5)
    base = timeline.origin
    for i in range(8):
        timeline.add("commit", HOST_LANE, base + i, base + i + 0.5, step=i)
    kept = timeline.since(-1.0)
    assert [s.step for s in kept] == [3, 4, 5, 6, 7]  # the three oldest were dropped
    assert [s.step for s in timeline.since(5.5)] == [6, 7]  # ended strictly after 5.5
    assert timeline.since(100.0) == []
    assert kept[0].start == pytest.approx(3.0) and kept[0].end == pytest.approx(3.5)  # on the timeline's clock
    timeline.add("prepare", HOST_LANE, base + 7.0, base + 7.2, step=8)  # another thread's span, appended late
    assert [s.step for s in timeline.since(7.1)] == [7, 8]


def test_ring_refuses_a_useless_capacity() -> None:
    with pytest.raises(ValueError, match="capacity must be at least 1, got 0"):
        StepTimeline(capacity=0)


def test_reads_while_another_thread_adds() -> None:
    timeline = StepTimeline(capacity=64)
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            timeline.add("forward+sample", DEVICE_LANE, timeline.origin + i, timeline.origin + i + 1, step=i)
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(2000):
            spans = timeline.since(-1.0)
            assert len(spans) <= 64
            assert all(a.step < b.step for a, b in itertools.pairwise(spans))  # one writer: in order, none torn
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_engine_records_every_step(tiny_llama: str, async_batching: bool) -> None:
    llm = LLM(
        model=tiny_llama,
        async_batching=async_batching,
        block_size=4,
        max_model_len=128,
        kv_cache_memory=2**20,
        max_num_batched_tokens=24,
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    lengths = [5 + 2 * i for i in range(6)]
    outs = llm.generate(
        prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths], use_tqdm=False
    )
    engine = llm.engine
    spans = engine.timeline.since(-1.0)
    device = [s for s in spans if s.lane == DEVICE_LANE]
    host = {s.name for s in spans if s.lane == HOST_LANE}
    assert {s.name for s in device} == {"forward+sample"}
    assert host == {"schedule", "prepare", "commit"}
    steps = [s.step for s in device]
    assert steps == sorted(set(steps)) and len(steps) <= engine.stats().num_steps  # one span per step run, in order
    # every generated token was sampled by exactly one step, and every prompt token computed once
    assert sum(s.num_sampled for s in device) == sum(len(o.outputs[0].token_ids) for o in outs) == sum(lengths)
    assert sum(s.num_tokens for s in device) == sum(len(p) for p in prompts) + sum(n - 1 for n in lengths)
    assert max(s.num_seqs for s in device) > 1  # continuous batching: several sequences in a step
    assert all(s.num_tokens <= 24 for s in device if s.num_steps == 1)  # the token budget held (chunked prefill)
    # a multi-step plan (every request a plain greedy final-only decode): one token per sequence per step
    assert all(s.num_tokens == s.num_sampled == s.num_seqs * s.num_steps for s in device if s.num_steps > 1)
    assert max(s.num_steps for s in device) > 1
    assert all(0 <= s.start <= s.end <= engine.timeline.now() for s in spans)


def test_preempted_requests_are_counted_while_they_wait(tiny_llama: str) -> None:
    llm = LLM(model=tiny_llama, block_size=4, max_model_len=96, kv_cache_memory=26 * 4 * 512, max_num_seqs=12)
    engine = llm.engine
    rng = random.Random(5)
    for _i in range(12):
        engine.add_request(
            [rng.randrange(2, 512) for _ in range(rng.randrange(10, 40))],
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        )
    seen = []
    while engine.has_work():
        engine.step()
        stats = engine.stats()
        assert 0 <= stats.num_preempted_waiting <= stats.num_waiting
        assert stats.kv_blocks_used == stats.kv_blocks_total - stats.kv_blocks_free >= 0
        seen.append(stats.num_preempted_waiting)
    assert engine.stats().num_preemptions > 0 and max(seen) > 0  # the cache was too small for all twelve
    assert seen[-1] == 0 and engine.stats().kv_blocks_used == 0
