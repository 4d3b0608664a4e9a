"""Scheduler driven by fake sampled tokens (no model, no torch).

`Driver` plays the engine: schedule -> "run" the plan on a fake KV store -> commit one
fake token per sampling row -> finish on max_tokens / max_model_len, as
conveyor/engine/output.py does. The fake KV store remembers, for every (block, slot),
the full token prefix whose KV it holds, so a step that would attend to missing or wrong
KV (a bad block table, a wrong prefix hit, a block overwritten by another request) fails.
The "runner" reads block tables and penalty histories only from a PersistentBatch kept
by the plans' deltas, as the model runner does, and checks it against a rebuild from the
scheduler's state (the block manager's tables, the requests' ids) after every plan.
"""

from __future__ import annotations

import zlib
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.kv_cache import BlockManager
from conveyor.core.persistent_batch import PersistentBatch
from conveyor.core.plan import PLACEHOLDER_TOKEN, ScheduledSeq, StepPlan
from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler import Scheduler, SchedulerLimits
from conveyor.params import SamplingParams


def fake_token(request_id: str, output_index: int) -> int:
    """The "model's" output: a fixed function of the request and the output's index."""
    return 1000 + zlib.crc32(f"{request_id}/{output_index}".encode()) % 1000


def make_request(rid: str, prompt: list[int], max_tokens: int, arrival: int, max_model_len: int = 256) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.1 if arrival % 2 else 1.0
    )  # half of them carry histories
    return Request(rid, list(prompt), params, seed=10_000 + arrival, arrival_index=arrival, max_model_len=max_model_len)


def expected_outputs(request: Request) -> list[int]:
    n = min(request.params.max_tokens, request.max_model_len - request.num_prompt_tokens)
    return [fake_token(request.request_id, i) for i in range(n)]


class Driver:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int = 256,
        prefix_caching: bool = True,
    ) -> None:
        self.limits = SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_model_len)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.limits, self.blocks)
        self.prefix_caching = prefix_caching
        self.requests: dict[str, Request] = {}
        self.terminal: dict[str, list[RequestStatus]] = defaultdict(list)
        self.computed: dict[str, int] = {}  # running request -> context length after its last planned step
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.plans: list[StepPlan] = []
        self.admitted: list[str] = []  # request ids in the order they were (re)admitted
        self.preempted: list[list[str]] = []  # per step with preemptions: the victims
        self.resumed: list[tuple[str, ScheduledSeq, int]] = []  # (id, seq, outputs at resume) after preemption
        self.sampled_at: dict[str, list[int]] = defaultdict(list)  # output indices committed, in order
        self.partial_prefills = 0
        self.batch = PersistentBatch()  # the runner's copy, kept by the plans' deltas alone

    # ---- engine-like surface ---------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_ids: list[str]) -> list[Request]:
        live = {rid for rid in request_ids if rid in self.requests and not self.requests[rid].is_finished}
        aborted = self.scheduler.abort(request_ids)
        assert {r.request_id for r in aborted} == live
        for r in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
            self.terminal[r.request_id].append(r.status)
            self.computed.pop(r.request_id, None)
        return aborted

    def finish(self, request: Request, status: RequestStatus) -> None:
        assert not request.is_finished
        self.scheduler.finish(request, status)
        assert request.status is status
        self.terminal[request.request_id].append(status)
        self.computed.pop(request.request_id, None)

    def step(self, abort_in_flight: list[str] = ()) -> StepPlan:
        running_before = [r.request_id for r in self.scheduler.running]
        waiting_before = [r.request_id for r in self.scheduler.waiting]
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        if not plan.is_empty:  # the engine never submits an empty plan
            self.batch.apply(plan)
            self._check_persistent_batch(plan)
        self._check_plan(plan, running_before, waiting_before)
        self._execute(plan)
        if abort_in_flight:
            self.abort(list(abort_in_flight))  # between planning and committing, like an async abort
        self._commit(plan)
        self.check_state()
        return plan

    def run(self, max_steps: int = 2000) -> int:
        steps = 0
        while self.scheduler.has_work():
            assert steps < max_steps, "no progress: the scheduler did not finish the workload"
            self.step()
            steps += 1
        return steps

    # ---- checks ----------------------------------------------------------------------------
    def _check_persistent_batch(self, plan: StepPlan) -> None:
        """The runner's copy equals a rebuild from scratch: it holds exactly the running requests, with their
        whole block tables and (with a penalty) every known id; what a plan carries is only what changed."""
        assert self.batch.request_ids == {r.request_id for r in self.scheduler.running}
        for r in self.scheduler.running:
            assert self.batch.block_table(r.request_id) == self.blocks.block_table(r.request_id)
        for seq in plan.seqs:
            req = self.requests[seq.request_id]
            if seq.block_table_start:  # a request the runner held: only entries it lacks travel
                assert len(seq.block_table_tail) <= self.blocks.blocks_needed(seq.num_tokens) + 1
            spec = seq.sampling
            if spec is None or not req.params.has_penalties:
                assert spec is None or spec.history_tail is None
                continue
            assert list(self.batch.history(seq.request_id)) == req.token_ids
            assert spec.num_history_placeholders == 0  # the Driver commits every step before the next
            if spec.history_start:
                assert len(spec.history_tail) == 1  # one committed token since its last sampled step

    def _check_plan(self, plan: StepPlan, running_before: list[str], waiting_before: list[str]) -> None:
        bs = self.blocks.block_size
        assert plan.num_tokens <= self.limits.max_num_batched_tokens
        assert len(plan.seqs) <= self.limits.max_num_seqs
        ids = [s.request_id for s in plan.seqs]
        assert len(set(ids)) == len(ids), "a request is planned twice in one step"

        # Preemption: victims are the newest running requests, moved to the front of the queue.
        victims = [rid for rid in running_before if self.requests[rid].status is RequestStatus.WAITING]
        assert len(victims) == plan.num_preempted
        if victims:
            self.preempted.append(victims)
            assert victims == running_before[len(running_before) - len(victims) :], "preempted a non-newest request"
            assert [r.request_id for r in list(self.scheduler.waiting)[: len(victims)]] == victims
            for rid in victims:
                req = self.requests[rid]
                assert req.num_computed_tokens == 0 and self.blocks.block_table(rid) == []
                assert req.num_preemptions >= 1
                self.computed.pop(rid)

        # Running requests come first (in their order), then FCFS admissions from the queue head.
        old = [rid for rid in ids if rid in running_before]
        new = [rid for rid in ids if rid not in running_before]
        assert ids == old + new, "a waiting request was planned before a running one"
        assert old == [rid for rid in running_before if rid in old]
        if plan.num_preempted:
            assert not new, "admitted a waiting request in a step that had to preempt"
        assert new == waiting_before[: len(new)], "admission is not first-come first-served"
        self.admitted += new

        for seq in plan.seqs:
            req = self.requests[seq.request_id]
            assert req.status is RequestStatus.RUNNING
            assert seq.num_tokens >= 1 and PLACEHOLDER_TOKEN not in seq.input_token_ids
            assert seq.input_token_ids == req.token_ids[seq.start_position : seq.context_len]
            if seq.request_id in old:
                assert seq.start_position == self.computed[seq.request_id]
            else:  # (re)admitted: starts after its prefix-cache hit, computing from scratch otherwise
                assert seq.start_position == req.num_cached_tokens
                assert seq.start_position % bs == 0 and seq.start_position < req.num_tokens
                if not self.prefix_caching:
                    assert seq.start_position == 0
                if req.num_preemptions:
                    self.resumed.append((seq.request_id, seq, req.num_output_tokens))
            self.computed[seq.request_id] = seq.context_len
            assert req.num_computed_tokens == seq.context_len
            assert len(self.batch.block_table(seq.request_id)) == self.blocks.blocks_needed(seq.context_len)
            if seq.context_len == req.num_tokens:
                spec = seq.sampling
                assert spec is not None, "a chunk reaching the end of the known tokens must sample"
                assert spec.output_index == req.num_output_tokens
                assert spec.seed == req.seed
                assert (spec.temperature, spec.top_k, spec.top_p) == (
                    req.params.temperature,
                    req.params.top_k,
                    req.params.top_p,
                )
                assert req.num_inflight_tokens == 1
            else:
                assert seq.context_len < req.num_tokens and seq.sampling is None
                self.partial_prefills += 1
        assert self.scheduler.stats.num_partial_prefills == self.partial_prefills

    def _execute(self, plan: StepPlan) -> None:
        """The fake model: write each input's KV, then check every attended slot holds the right KV."""
        bs = self.blocks.block_size
        written: set[tuple[int, int]] = set()
        for seq in plan.seqs:
            tokens = self.requests[seq.request_id].token_ids
            table = self.batch.block_table(seq.request_id)
            for pos in range(seq.start_position, seq.context_len):
                slot = (table[pos // bs], pos % bs)
                assert slot not in written, f"two sequences write KV slot {slot} in one step"
                written.add(slot)
                self.kv[slot] = tuple(tokens[: pos + 1])  # KV at pos depends on the whole prefix
        for seq in plan.seqs:
            tokens = self.requests[seq.request_id].token_ids
            table = self.batch.block_table(seq.request_id)
            for pos in range(seq.context_len):
                slot = (table[pos // bs], pos % bs)
                assert self.kv.get(slot) == tuple(tokens[: pos + 1]), (
                    f"{seq.request_id} would attend to wrong KV at position {pos} (slot {slot})"
                )

    def _commit(self, plan: StepPlan) -> None:
        for seq in plan.sampling_seqs:
            req = self.requests[seq.request_id]
            if req.is_finished:
                continue  # aborted while its step was in flight: the token is dropped
            assert seq.sampling.output_index == req.num_output_tokens
            self.scheduler.commit_token(req, fake_token(req.request_id, seq.sampling.output_index))
            self.sampled_at[req.request_id].append(seq.sampling.output_index)
            if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= req.max_model_len:
                self.finish(req, RequestStatus.FINISHED_LENGTH)

    def check_state(self) -> None:
        s = self.scheduler
        self.blocks.check_invariants()
        running, waiting = list(s.running), list(s.waiting)
        live = {rid for rid, r in self.requests.items() if not r.is_finished}
        assert {r.request_id for r in running} | {r.request_id for r in waiting} == live
        assert len(running) + len(waiting) == len(live) == s.num_unfinished
        assert len(running) <= self.limits.max_num_seqs
        assert all(r.status is RequestStatus.RUNNING for r in running)
        assert all(r.status is RequestStatus.WAITING for r in waiting)
        # FCFS as a state: running oldest first, and everything running arrived before anything waiting.
        order = [r.arrival_index for r in running] + [r.arrival_index for r in waiting]
        assert order == sorted(order)
        for r in running:
            assert r.num_inflight_tokens == 0
            assert len(self.blocks.block_table(r.request_id)) == self.blocks.blocks_needed(r.num_computed_tokens)
        for r in waiting:
            assert self.blocks.block_table(r.request_id) == []
        for rid, r in self.requests.items():
            if r.is_finished:
                assert s.get(rid) is None and self.blocks.block_table(rid) == []
        if not s.has_work():
            assert self.blocks.num_allocated == 0, "KV blocks leaked while idle"

    def check_all_done(self) -> None:
        assert not self.scheduler.has_work() and self.blocks.num_allocated == 0
        for rid, req in self.requests.items():
            assert len(self.terminal[rid]) == 1, f"{rid} ended {len(self.terminal[rid])} times"
            assert req.status is self.terminal[rid][0] and req.is_finished
            want = expected_outputs(req)
            assert self.sampled_at[rid] == list(range(req.num_output_tokens))
            if req.status is RequestStatus.FINISHED_LENGTH:
                assert req.output_token_ids == want
            else:
                assert req.status is RequestStatus.FINISHED_ABORTED
                assert req.output_token_ids == want[: req.num_output_tokens]
            assert req.token_ids[: req.num_prompt_tokens] == req.prompt_token_ids


def prompt_of(n: int, salt: int) -> list[int]:
    return [(salt * 131 + i * 7) % 500 for i in range(n)]


# ---- deterministic scenarios ------------------------------------------------------------


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    d = Driver(num_blocks=200, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    for i, (n, m) in enumerate([(5, 3), (60, 4), (17, 9), (33, 2), (8, 8), (41, 5), (3, 10), (29, 6)]):
        d.add(make_request(f"r{i}", prompt_of(n, i), m, i))
    d.run()
    d.check_all_done()
    assert max(p.num_tokens for p in d.plans) == 32  # the budget was the binding limit at times
    assert max(len(p.seqs) for p in d.plans) == 4  # and so was max_num_seqs


def test_chunked_prefill_samples_once_per_output_at_the_right_position() -> None:
    d = Driver(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    d.add(make_request("a", prompt_of(50, 1), 4, 0))
    d.add(make_request("b", prompt_of(23, 2), 3, 1))
    d.run()
    d.check_all_done()
    assert d.scheduler.stats.num_partial_prefills > 0
    sampled = [(s.request_id, s.context_len, s.sampling.output_index) for p in d.plans for s in p.sampling_seqs]
    assert [(c, i) for rid, c, i in sampled if rid == "a"] == [(50 + i, i) for i in range(4)]
    assert [(c, i) for rid, c, i in sampled if rid == "b"] == [(23 + i, i) for i in range(3)]
    chunks_a = [s.num_tokens for p in d.plans for s in p.seqs if s.request_id == "a" and s.context_len <= 50]
    assert sum(chunks_a) == 50 and len(chunks_a) == 4  # 16 + 16 + 16 + 2


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    d = Driver(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    d.add(make_request("a", prompt_of(4, 1), 20, 0))
    d.step()  # a's prefill
    d.add(make_request("b", prompt_of(100, 2), 2, 1))
    both = 0
    while d.scheduler.has_work():
        b_left = d.requests["b"].num_tokens_to_compute
        plan = d.step()
        if len(plan.seqs) == 2:
            both += 1
            assert [s.request_id for s in plan.seqs] == ["a", "b"]
            assert plan.seqs[0].num_tokens == 1  # a's decode first, b takes what is left
            assert plan.seqs[1].num_tokens == min(7, b_left)
    d.check_all_done()
    assert both >= 10


def test_fcfs_admission_under_max_num_seqs() -> None:
    d = Driver(num_blocks=100, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    for i, m in enumerate([5, 1, 3, 2, 4, 1]):
        d.add(make_request(f"r{i}", prompt_of(6, i), m, i))
    d.run()
    d.check_all_done()
    assert d.admitted == [f"r{i}" for i in range(6)]


def test_fcfs_a_blocked_head_is_not_overtaken() -> None:
    # 8 blocks of 4: "a" takes 6-7 blocks; "b" needs 4 for its prompt; "c" would fit in 1.
    d = Driver(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    d.add(make_request("a", prompt_of(24, 1), 4, 0, max_model_len=32))
    d.add(make_request("b", prompt_of(16, 2), 2, 1, max_model_len=32))
    d.add(make_request("c", prompt_of(2, 3), 2, 2, max_model_len=32))
    first = {}
    step = 0
    while d.scheduler.has_work():
        plan = d.step()
        for s in plan.seqs:
            first.setdefault(s.request_id, step)
        step += 1
    d.check_all_done()
    assert first["a"] == 0 and first["b"] > 0
    assert first["c"] >= first["b"]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_takes_the_newest_and_recomputes(prefix_caching: bool) -> None:
    # 6 blocks of 4 tokens; each request grows to 5 blocks, so three cannot run together.
    d = Driver(
        num_blocks=6,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        max_model_len=24,
        prefix_caching=prefix_caching,
    )
    for i in range(3):
        d.add(make_request(f"r{i}", prompt_of(8, i), 10, i, max_model_len=24))
    d.run()
    d.check_all_done()
    assert d.scheduler.stats.num_preemptions > 0
    assert d.preempted[0][-1] == "r2" and "r0" not in d.preempted[0]  # the newest goes first
    assert sum(r.num_preemptions for r in d.requests.values()) == d.scheduler.stats.num_preemptions
    # Resumed requests recompute prompt + the outputs they had already generated.
    with_outputs = [(rid, seq, n) for rid, seq, n in d.resumed if n > 0]
    assert with_outputs, "no request was preempted after generating output"
    for rid, seq, n_out in with_outputs:
        req = d.requests[rid]
        full = req.prompt_token_ids + req.output_token_ids[:n_out]
        assert seq.start_position == req.num_cached_tokens or seq.start_position == 0
        assert seq.input_token_ids == full[seq.start_position : seq.context_len]
        if not prefix_caching:
            assert seq.start_position == 0 and seq.input_token_ids == full
            assert seq.sampling is not None and seq.sampling.output_index == n_out


def test_preempted_request_state_is_reset() -> None:
    d = Driver(
        num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=16, prefix_caching=False
    )
    d.add(make_request("old", prompt_of(7, 1), 8, 0, max_model_len=16))
    d.add(make_request("new", prompt_of(7, 2), 8, 1, max_model_len=16))
    while not d.preempted:
        d.step()
    assert d.preempted[0] == ["new"]
    new = d.requests["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and new.num_output_tokens > 0
    assert next(iter(d.scheduler.waiting)) is new
    d.run()
    d.check_all_done()


def test_abort_waiting_and_running_requests() -> None:
    d = Driver(num_blocks=50, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = make_request("a", prompt_of(9, 1), 10, 0), make_request("b", prompt_of(5, 2), 10, 1)
    d.add(a)
    d.add(b)
    d.step()
    d.step()
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    assert d.blocks.num_allocated > 0

    assert d.abort(["b", "no-such-request"]) == [b]
    assert b.status is RequestStatus.FINISHED_ABORTED and b.finish_reason == "abort"
    assert d.scheduler.get("b") is None and b not in d.scheduler.waiting

    assert d.abort(["a"]) == [a]
    assert a.status is RequestStatus.FINISHED_ABORTED and a not in d.scheduler.running
    assert not d.scheduler.has_work() and d.blocks.num_allocated == 0
    d.check_state()

    assert d.abort(["a", "b"]) == []  # a second abort finds nothing
    d.scheduler.finish(a, RequestStatus.FINISHED_LENGTH)  # finishing twice changes nothing
    assert a.status is RequestStatus.FINISHED_ABORTED
    d.check_all_done()


def test_abort_while_the_step_is_in_flight_drops_the_token() -> None:
    d = Driver(num_blocks=50, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    d.add(make_request("a", prompt_of(9, 1), 10, 0))
    d.add(make_request("b", prompt_of(5, 2), 3, 1))
    d.step()
    plan = d.step(abort_in_flight=["a"])
    assert "a" in [s.request_id for s in plan.sampling_seqs]
    assert d.requests["a"].num_output_tokens == 1  # the in-flight token was not committed
    d.run()
    d.check_all_done()
    assert d.requests["b"].status is RequestStatus.FINISHED_LENGTH


def test_request_ids_must_be_unique() -> None:
    d = Driver(num_blocks=10, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    d.add(make_request("x", [1, 2, 3], 2, 0))
    with pytest.raises(ValueError, match="'x'"):
        d.scheduler.add(make_request("x", [4, 5], 2, 1))


def test_max_model_len_ends_a_request_with_length() -> None:
    d = Driver(num_blocks=10, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=12)
    d.add(make_request("x", prompt_of(9, 1), 100, 0, max_model_len=12))
    d.run()
    d.check_all_done()
    assert d.requests["x"].num_output_tokens == 3


# ---- random workloads -----------------------------------------------------------------------

DOCUMENTS = ([3] * 64, list(range(64)), [i % 5 for i in range(64)])
PROMPTS = st.builds(
    lambda doc, cut, tail: (DOCUMENTS[doc][:cut] + tail) or [1],
    st.integers(0, 2),
    st.integers(0, 40),
    st.lists(st.integers(100, 110), max_size=8),
)


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = 64
    min_blocks = -(-max_model_len // block_size)
    prompts = draw(st.lists(PROMPTS, min_size=1, max_size=10))
    return dict(
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, 3 * min_blocks)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        prefix_caching=draw(st.booleans()),
        max_model_len=max_model_len,
        requests=[(p[: max_model_len - 1], draw(st.integers(1, 30)), draw(st.integers(0, 5))) for p in prompts],
        aborts=draw(
            st.lists(st.tuples(st.integers(0, 40), st.integers(0, len(prompts) - 1), st.booleans()), max_size=4)
        ),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_exactly_once_without_leaks(w: dict) -> None:
    d = Driver(
        num_blocks=w["num_blocks"],
        block_size=w["block_size"],
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["max_num_batched_tokens"],
        max_model_len=w["max_model_len"],
        prefix_caching=w["prefix_caching"],
    )
    # Requests arrive over time: (prompt, max_tokens, arrival step).
    arrivals = sorted(enumerate(w["requests"]), key=lambda item: (item[1][2], item[0]))
    aborts = defaultdict(list)
    for step, index, in_flight in w["aborts"]:
        aborts[step].append((f"r{index}", in_flight))
    next_arrival, step = 0, 0
    while next_arrival < len(arrivals) or d.scheduler.has_work():
        assert step < 3000, "no progress"
        while next_arrival < len(arrivals) and arrivals[next_arrival][1][2] <= step:
            i, (prompt, max_tokens, _) = arrivals[next_arrival]
            d.add(make_request(f"r{i}", prompt, max_tokens, next_arrival, max_model_len=w["max_model_len"]))
            next_arrival += 1
        d.abort([rid for rid, in_flight in aborts[step] if not in_flight])
        d.step(abort_in_flight=[rid for rid, in_flight in aborts[step] if in_flight])
        step += 1
    assert len(d.requests) == len(w["requests"])
    d.check_all_done()


def test_step_tokens_count_as_vllm_counts_iterations() -> None:
    """One token per token sampled, plus a sequence's whole prompt in the step that samples its first token (chunks
    before it count 0, a prompt served from the prefix cache counts whole): vllm:iteration_tokens_total."""
    d = Driver(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=6)
    prompt = list(range(1, 15))  # 14 tokens: chunks of 6, 6 and 2
    d.add(make_request("a", prompt, max_tokens=3, arrival=0))
    d.run()
    d.add(make_request("b", prompt, max_tokens=3, arrival=1))  # 12 of its tokens from the prefix cache: one step
    d.run()
    tokens = d.scheduler.stats.step_tokens
    assert tokens.total == 2 * (14 + 3)
    assert sum(tokens.counts) == (3 + 2) + (1 + 2)  # a: three chunks, two decodes; b: one prefill, two decodes
    assert tokens.counts[0] == 2 + 4  # the chunks that sample nothing (0) and the decodes (1): bucket <= 1
    assert tokens.counts[2] == 2  # the steps that end a prompt: 14 + 1, bucket <= 16
