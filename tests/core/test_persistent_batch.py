"""The runner's PersistentBatch (block tables, penalty histories kept from the plans' deltas) against the
scheduler's own state, step after step, through the real engine under async batching, preemption, prefix
caching, copy-on-write (n > 1) and penalties; and a delta that does not fit the copy held is refused."""

from __future__ import annotations

import random
from typing import Any

import pytest

from conveyor.core.persistent_batch import PersistentBatch
from conveyor.core.plan import SamplingSpec, ScheduledSeq, StepPlan
from conveyor.llm import LLM
from conveyor.params import SamplingParams
from helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: Any) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-llama-persistent"))
    build_tiny_model("llama", folder)
    return folder


def _params(i: int) -> SamplingParams:
    return [
        SamplingParams(max_tokens=18, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=i, frequency_penalty=0.7, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0.8, seed=i, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=1.0, min_tokens=3),
    ][i % 4]


@pytest.mark.parametrize("async_batching", [True, False])
def test_runner_copy_equals_the_scheduler_state_after_every_step(tiny_llama: str, async_batching: bool) -> None:
    llm = LLM(
        model=tiny_llama,
        async_batching=async_batching,
        block_size=4,
        max_model_len=96,
        kv_cache_memory=30 * 4 * 512,
        max_num_seqs=12,
        max_num_batched_tokens=24,
    )
    engine = llm.engine
    rng = random.Random(3)
    shared = [rng.randrange(2, 512) for _ in range(12)]  # a common prefix: prefix-cache hits
    pending = [
        shared[: rng.randrange(0, 12)] + [rng.randrange(2, 512) for _ in range(rng.randrange(1, 40))] for _ in range(24)
    ]
    checked = steps = histories = 0
    try:
        while pending or engine.has_work():
            for _ in range(rng.randrange(0, 3)):  # arrivals while others run
                if pending:
                    engine.add_request(pending.pop(), _params(len(pending)))
            engine.step()
            steps += 1
            assert steps < 2000, "no progress"
            batch, blocks = engine.runner.batch, engine.blocks
            for request in engine.scheduler.running:  # every running request was planned, so the runner holds it
                rid = request.request_id
                assert rid in batch.request_ids
                assert batch.block_table(rid) == blocks.block_table(rid), f"step {steps}: {rid}'s block table"
                known = list(batch.history(rid))  # as of its last sampled plan; outputs committed since come later
                if request.params.has_penalties and request.num_output_tokens and not request.num_preemptions:
                    assert known, f"step {steps}: {rid} sampled with a penalty, but the runner has no history"
                if known:  # (a resumed request keeps none until it samples again)
                    assert request.params.has_penalties
                    assert request.num_prompt_tokens <= len(known) <= request.num_tokens
                    assert known == request.token_ids[: len(known)], f"step {steps}: {rid}'s penalty history"
                    histories += 1
                checked += 1
        stats = engine.stats()
        assert stats.num_preemptions > 0, "the small cache was meant to force preemption"
        assert blocks.prefix_hit_tokens > 0, "the shared prefix was meant to hit the prefix cache"
        assert checked > 100 and histories > 50
        engine.check_idle()
    finally:
        engine.close()


def _seq(
    rid: str, tail: list[int], start: int, history: tuple[int, ...] | None = None, history_start: int = 0
) -> ScheduledSeq:
    spec = SamplingSpec(
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        output_index=0,
        repetition_penalty=1.2,
        history_tail=history,
        history_start=history_start,
    )
    return ScheduledSeq(rid, [1], 8, tail, start, spec if history is not None else None)


def test_deltas_rebuild_the_table_and_history_and_a_missed_plan_is_refused_by_name() -> None:
    batch = PersistentBatch()
    batch.apply(StepPlan(0, [_seq("a", [7, 2], 0, (5, 6, 7), 0)]))
    batch.apply(StepPlan(1, [_seq("a", [9, 4], 1, (8,), 3)]))  # entry 1 replaced (copy-on-write), 4 appended
    assert batch.block_table("a") == [7, 9, 4] and list(batch.history("a")) == [5, 6, 7, 8]
    batch.apply(StepPlan(2, [_seq("b", [3], 0)], dropped_ids=["a"]))
    assert batch.request_ids == {"b"} and batch.block_table("a") == []
    with pytest.raises(RuntimeError, match="request 'b' keeps 2 block table entries, but the runner holds 1"):
        batch.apply(StepPlan(3, [_seq("b", [5], 2)]))
    batch.apply(StepPlan(4, [_seq("c", [1], 0, (1, 2), 0)]))
    with pytest.raises(
        RuntimeError, match="request 'c' continues its penalty history at 3 ids, but the runner holds 2"
    ):
        batch.apply(StepPlan(5, [_seq("c", [], 1, (4,), 3)]))
