"""Multi-step decode plans (EngineConfig.num_scheduler_steps): the scheduler's choice of how many steps a plan
runs, and the engine's tokens and texts the same as with one step per plan, token for token."""

from __future__ import annotations

import random
from typing import Any

import pytest

from conveyor import SamplingParams
from conveyor.config import EngineConfig
from conveyor.core.kv_cache import BlockManager
from conveyor.core.plan import StepPlan
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerLimits
from conveyor.engine.engine import Engine
from helpers.tiny_models import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def _scheduler(max_steps: int = 4, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerLimits(8, 64, 256, None, max_steps), BlockManager(num_blocks, 4))


def _request(rid: str, arrival: int, params: SamplingParams = GREEDY, multi_step: bool = True) -> Request:
    return Request(
        rid, [5, 6, 7, 8, 9, 10], params, seed=arrival, arrival_index=arrival, max_model_len=256, multi_step=multi_step
    )


def _commit(scheduler: Scheduler, plan: StepPlan) -> None:
    for seq in plan.sampling_seqs:
        request = scheduler.get(seq.request_id)
        assert request is not None
        for _ in range(plan.num_steps):
            scheduler.commit_token(request, 100 + request.num_output_tokens)


def test_decodes_of_multi_step_requests_run_several_steps_per_plan() -> None:
    scheduler = _scheduler()
    for i in range(3):
        scheduler.add(_request(f"r{i}", i))
    prefill = scheduler.schedule()
    assert prefill.num_steps == 1  # prompt chunks: one step
    _commit(scheduler, prefill)
    plan = scheduler.schedule()
    assert plan.num_steps == 4 and [len(s.input_token_ids) for s in plan.seqs] == [1, 1, 1]
    for seq in plan.seqs:  # every step's slot is allocated and sent to the runner
        request = scheduler.get(seq.request_id)
        assert request is not None and request.num_computed_tokens == seq.start_position + 4
        assert request.num_inflight_tokens == 4
        assert len(seq.block_table_tail) + seq.block_table_start >= -(-(seq.start_position + 4) // 4)
    _commit(scheduler, plan)
    assert all(scheduler.get(f"r{i}").num_output_tokens == 5 for i in range(3))  # type: ignore[union-attr]


def test_one_step_per_plan_where_a_request_waits_streams_or_samples() -> None:
    def decode_plan(*requests: Request, waiting: Request | None = None, blocks: int = 64) -> StepPlan:
        scheduler = _scheduler(num_blocks=blocks)
        for r in requests:
            scheduler.add(r)
        _commit(scheduler, scheduler.schedule())
        if waiting is not None:
            scheduler.limits = SchedulerLimits(len(requests), 64, 256, None, 4)  # no room for it
            scheduler.add(waiting)
        return scheduler.schedule()

    assert decode_plan(_request("a", 0), _request("b", 1)).num_steps == 4
    assert decode_plan(_request("a", 0), _request("b", 1, multi_step=False)).num_steps == 1  # streamed
    assert decode_plan(_request("a", 0), waiting=_request("w", 5)).num_steps == 1  # someone waits
    assert decode_plan(_request("a", 0, GREEDY.clone(max_tokens=3))).num_steps == 2  # two tokens left
    assert decode_plan(_request("a", 0, GREEDY.clone(min_tokens=4))).num_steps == 1  # EOS still suppressed
    assert decode_plan(_request("a", 0), _request("b", 1), blocks=5).num_steps == 1  # no blocks for 4 steps


@pytest.fixture(scope="module")
def engines() -> Any:
    made = {
        key: Engine(
            EngineConfig(
                dtype="bfloat16",
                async_batching=asyncb,
                num_scheduler_steps=steps,
                kv_cache_memory="128MiB",
                max_model_len=512,
            )
        )
        for key, (steps, asyncb) in {"one": (1, False), "sync": (5, False), "async": (3, True)}.items()
    }
    yield made
    for engine in made.values():
        engine.close()


def _run(
    engine: Engine, requests: list[tuple[str, SamplingParams]], streamed: int | None = None
) -> tuple[list[Any], list[int]]:
    """Outputs in request order, and the num_steps of every plan made."""
    plans: list[int] = []
    schedule = engine.scheduler.schedule

    def recording(*args: Any, **kwargs: Any) -> StepPlan:
        plan = schedule(*args, **kwargs)
        plans.append(plan.num_steps)
        return plan

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    try:
        ids = [engine.add_request(p, params, final_only=i != streamed) for i, (p, params) in enumerate(requests)]
        final: dict[str, Any] = {}
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
    finally:
        del engine.scheduler.schedule
    engine.check_idle()
    return [final[i] for i in ids], plans


def _summary(outputs: list[Any]) -> list[tuple[Any, ...]]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outputs for c in o.outputs]


def test_multi_step_tokens_and_stops_equal_one_step_per_plan(engines: dict[str, Engine]) -> None:
    prompts = [
        "Once upon a time",
        "The capital of France is",
        "1, 2, 3, 4,",
        "def fib(n):",
        "Dear Sir,",
        "In 1492, Columbus",
    ]
    plain = [(p, GREEDY.clone(max_tokens=9 + 3 * i, ignore_eos=i % 2 == 0)) for i, p in enumerate(prompts)]
    reference, one_plans = _run(engines["one"], plain)
    assert set(one_plans) == {1}
    tokens = [o.outputs[0].token_ids for o in reference]
    texts = [o.outputs[0].text for o in reference]
    stop_id = tokens[1][6]  # a stop token id and a stop string found inside a later step of a plan
    stop_text = texts[3][len(texts[3]) // 2 :][:3]
    stopped = [
        (prompts[1], GREEDY.clone(max_tokens=20, stop_token_ids=[stop_id])),
        (prompts[3], GREEDY.clone(max_tokens=20, stop=[stop_text])),
        (prompts[4], GREEDY.clone(max_tokens=20, stop=[stop_text], include_stop_str_in_output=True)),
    ]
    want = _summary(reference) + _summary(_run(engines["one"], stopped)[0])
    for key in ("sync", "async"):
        first, plans = _run(engines[key], plain)
        later, _ = _run(engines[key], stopped)
        assert _summary(first) + _summary(later) == want, key
        assert max(plans) == engines[key].config.num_scheduler_steps  # the plans did run several steps
    assert [o.outputs[0].finish_reason for o in reference[:2]] == ["length", "length"]


def test_a_streamed_request_keeps_every_plan_to_one_step(engines: dict[str, Engine]) -> None:
    requests = [("Once upon a time", GREEDY.clone(max_tokens=12)), ("Dear Sir,", GREEDY.clone(max_tokens=12))]
    outputs, plans = _run(engines["sync"], requests, streamed=0)
    assert set(plans) == {1}
    assert _summary(outputs) == _summary(_run(engines["one"], requests)[0])


def test_multi_step_on_torch_kernels_with_several_decode_groups(tmp_path: Any) -> None:
    """The torch reference path (kernels='torch', float32): 40 decodes attend in groups of 32 sorted by context
    length, each group with its own masks; every plan's later steps move each group's lengths and the slots."""
    folder = str(tmp_path / "tiny-llama")
    build_tiny_model("llama", folder)
    rng = random.Random(3)
    requests = [
        (
            [rng.randrange(2, 512) for _ in range(rng.randrange(1, 50))],
            SamplingParams(temperature=0.0, max_tokens=6 + i % 13, ignore_eos=i % 3 != 0),
        )
        for i in range(40)
    ]
    results = []
    for steps in (1, 4):
        engine = Engine(
            EngineConfig(
                model=folder,
                kernels="torch",
                dtype="float32",
                num_scheduler_steps=steps,
                async_batching=False,
                max_model_len=256,
                block_size=8,
            )
        )
        try:
            outputs, plans = _run(engine, requests)
        finally:
            engine.close()
        results.append(_summary(outputs))
        assert max(plans) == steps
    assert results[0] == results[1]
