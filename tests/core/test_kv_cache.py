"""BlockManager and CachePlan: block accounting, prefix caching, LRU eviction (no torch, no model)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conveyor.core.kv_cache import EMPTY_MATCH, BlockManager, CachePlan, PrefixMatch
from conveyor.errors import ConfigError


def pools(bm: BlockManager) -> tuple[int, int, int]:
    """(allocated, cached, plain free) as seen through the public surface."""
    cached = bm.num_cached_blocks
    return bm.num_allocated, cached, bm.num_free_blocks - cached


def filled(bm: BlockManager, rid: str, tokens: list[int]) -> list[int]:
    """Allocate a new request for `tokens`, mark all of them computed; return its block table."""
    bm.allocate(rid, len(tokens))
    bm.register_full_blocks(rid, tokens, len(tokens))
    return list(bm.block_table(rid))


# ---- allocate / free accounting ----------------------------------------------------------


def test_allocate_grow_and_free_accounting() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    assert pools(bm) == (0, 0, 10)

    first = bm.allocate("a", 9)  # 9 tokens -> 3 blocks
    assert len(first) == 3 and len(set(first)) == 3
    assert bm.block_table("a") == first
    assert pools(bm) == (3, 0, 7)
    assert bm.usage == pytest.approx(0.3)

    assert bm.allocate("a", 12) == []  # still fits in 3 blocks
    grown = bm.allocate("a", 13)
    assert len(grown) == 1 and grown[0] not in first
    assert bm.block_table("a") == first + grown

    other = bm.allocate("b", 1)
    assert len(other) == 1 and not set(other) & set(bm.block_table("a"))
    assert pools(bm) == (5, 0, 5)
    bm.check_invariants()

    assert bm.free("a") == 4
    assert bm.block_table("a") == []
    assert pools(bm) == (1, 0, 9)  # no hashes were registered, so nothing is cached
    assert bm.free("a") == 0 and bm.free("never-seen") == 0
    assert bm.free("b") == 1
    assert pools(bm) == (0, 0, 10)
    bm.check_invariants()


def test_blocks_needed_rounds_up() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    assert [bm.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_can_allocate_is_exact_at_the_boundary() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("a", 8)  # 2 blocks, 4 left = 16 token slots
    assert bm.can_allocate("b", 16)
    assert not bm.can_allocate("b", 17)
    # growing counts the blocks the request already holds
    assert bm.can_allocate("a", 8 + 16)
    assert not bm.can_allocate("a", 8 + 17)


def test_allocate_without_room_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    before = copy.deepcopy(bm.__dict__)
    assert not bm.can_allocate("b", 5)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate("b", 5)
    assert bm.__dict__ == before
    bm.check_invariants()


def test_can_allocate_counts_cached_blocks_and_revived_prefix_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(12))
    table = filled(bm, "a", tokens)  # 3 full blocks, hashed
    bm.free("a")
    assert pools(bm) == (0, 3, 1)

    # Cached blocks are evictable, so a plain request may use all four.
    assert bm.can_allocate("x", 16) and not bm.can_allocate("x", 17)

    # A prefix hit on 2 cached blocks revives them: 2 revived + 2 new == 4 available.
    query = tokens[:8] + [100] * 8
    prefix = bm.find_cached_prefix(query)
    assert prefix == PrefixMatch(table[:2], 8)
    assert bm.can_allocate("b", 16, prefix)
    assert not bm.can_allocate("b", 17, prefix)
    new = bm.allocate("b", 16, prefix)
    assert len(new) == 2
    assert bm.block_table("b")[:2] == table[:2]
    assert pools(bm) == (4, 0, 0)
    bm.check_invariants()


def test_prefix_blocks_held_by_a_running_request_cost_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(8))
    table = filled(bm, "a", tokens)  # 2 blocks, still allocated to "a"
    prefix = bm.find_cached_prefix([*tokens, 50])
    assert prefix.block_ids == table
    # 2 free blocks left; "b" shares a's 2 blocks and needs 2 more for 16 tokens.
    assert bm.can_allocate("b", 16, prefix)
    assert not bm.can_allocate("b", 17, prefix)
    bm.allocate("b", 16, prefix)
    assert bm.num_allocated == 4  # shared blocks are counted once
    bm.check_invariants()
    bm.free("a")
    assert bm.num_allocated == 4  # still held by "b"
    bm.free("b")
    assert bm.num_allocated == 0
    bm.check_invariants()


# ---- prefix caching -----------------------------------------------------------------------


def test_prefix_hit_only_for_full_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    table = filled(bm, "a", tokens)
    bm.free("a")

    match = bm.find_cached_prefix([*tokens, 70, 71, 72])  # 13 tokens: 3 blocks could be hit
    assert match == PrefixMatch(table[:2], 8)  # the partial third block is never a hit
    assert bm.find_cached_prefix([*tokens[:8], 1, 2, 3, 4, 5]).num_tokens == 8
    # A different first block means no hit at all, even if the second matches.
    assert bm.find_cached_prefix([99, *tokens[1:]]) == EMPTY_MATCH
    # A different second block keeps the first.
    assert bm.find_cached_prefix([*tokens[:4], 99, *tokens[5:]]) == PrefixMatch(table[:1], 4)


def test_prefix_hit_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    table = filled(bm, "a", tokens)
    bm.free("a")
    # Exactly the cached tokens: the last block is not used, one block's worth is recomputed.
    assert bm.find_cached_prefix(tokens) == PrefixMatch(table[:1], 4)
    assert bm.find_cached_prefix([*tokens, 8]) == PrefixMatch(table, 8)
    assert bm.find_cached_prefix(tokens[:4]) == EMPTY_MATCH
    assert bm.find_cached_prefix(tokens[:5]) == PrefixMatch(table[:1], 4)
    assert bm.find_cached_prefix([]) == EMPTY_MATCH


def test_prefix_hash_hit_is_rechecked_against_token_ids() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    table = filled(bm, "a", tokens)
    bm.free("a")
    query = [*tokens, 99]
    assert bm.find_cached_prefix(query).num_tokens == 12

    # Simulate a corrupted entry (e.g. a hash collision): the hash still points at the
    # block but the block holds other tokens. It must not be served.
    bm._tokens_of_block[table[1]] = (40, 41, 42, 43)
    assert bm.find_cached_prefix(query) == PrefixMatch(table[:1], 4)
    bm._tokens_of_block[table[0]] = (0, 1, 2, 5)
    assert bm.find_cached_prefix(query) == EMPTY_MATCH


def test_prefix_hit_counts_and_refcounts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    filled(bm, "a", tokens)
    bm.free("a")
    assert bm.prefix_hit_tokens == 0
    prefix = bm.find_cached_prefix([*tokens, 1])
    bm.allocate("b", 9, prefix)
    bm.allocate("c", 9, bm.find_cached_prefix([*tokens, 2]))
    assert bm.prefix_hit_tokens == 16
    assert bm.block_table("b")[:2] == bm.block_table("c")[:2]
    assert bm.block_table("b")[2] != bm.block_table("c")[2]
    assert bm.num_allocated == 4
    bm.check_invariants()
    bm.free("b")
    assert bm.num_cached_blocks == 0  # still held by "c"
    bm.free("c")
    assert bm.num_cached_blocks == 2 and bm.num_allocated == 0
    bm.check_invariants()


def test_prefix_on_a_request_that_already_has_blocks_is_refused() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    filled(bm, "a", tokens)
    bm.allocate("b", 1)
    with pytest.raises(RuntimeError, match="already has blocks"):
        bm.allocate("b", 9, bm.find_cached_prefix([*tokens, 1]))


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    tokens = list(range(12))
    filled(bm, "a", tokens)
    bm.free("a")
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.find_cached_prefix([*tokens, 1]) == EMPTY_MATCH
    bm.check_invariants()


def test_register_only_blocks_filled_by_known_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    bm.allocate("a", 12)
    bm.register_full_blocks("a", tokens, 7)  # only block 0 is completely known
    bm.free("a")
    assert bm.num_cached_blocks == 1
    assert bm.find_cached_prefix([*tokens, 1]).num_tokens == 4


# ---- LRU eviction -------------------------------------------------------------------------


def test_eviction_is_least_recently_freed_first_tail_blocks_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    toks = {rid: [base + i for i in range(4)] for rid, base in (("a", 0), ("b", 10), ("c", 20))}
    tables = {rid: filled(bm, rid, t) for rid, t in toks.items()}  # 2 full blocks each
    for rid in ("a", "b", "c"):
        bm.free(rid)
    assert pools(bm) == (0, 6, 0)

    def hit(rid: str) -> int:
        return bm.find_cached_prefix(toks[rid] + [99]).num_tokens

    expected_order = [tables["a"][1], tables["a"][0], tables["b"][1], tables["b"][0], tables["c"][1], tables["c"][0]]
    evicted = []
    for n in range(6):
        evicted += bm.allocate(f"new{n}", 1)
        bm.check_invariants()
        if n == 0:
            assert (hit("a"), hit("b"), hit("c")) == (2, 4, 4)  # a's tail went first, its head survives
        if n == 1:
            assert (hit("a"), hit("b"), hit("c")) == (0, 4, 4)
    assert evicted == expected_order
    assert pools(bm) == (6, 0, 0)


def test_prefix_hit_refreshes_recency() -> None:
    bm = BlockManager(num_blocks=5, block_size=2)
    ta = filled(bm, "a", [1, 2, 3, 4])
    tb = filled(bm, "b", [5, 6, 7, 8])
    bm.free("a")
    bm.free("b")
    # Reuse a's blocks, then free them again: now b's blocks are the least recently freed.
    bm.allocate("a2", 5, bm.find_cached_prefix([1, 2, 3, 4, 9]))
    bm.free("a2")  # frees a's 2 blocks plus one new tail block (hashless)
    evicted = bm.allocate("x", 2 * 3)  # 1 plain free block, then b's tail, then b's head
    assert evicted[1:] == [tb[1], tb[0]]
    assert bm.find_cached_prefix([1, 2, 3, 4, 9]) == PrefixMatch(ta, 4)
    assert bm.find_cached_prefix([5, 6, 7, 8, 9]) == EMPTY_MATCH


def test_plain_free_blocks_are_used_before_evicting_cached_ones() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    filled(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    assert pools(bm) == (0, 2, 4)
    bm.allocate("b", 8)  # 4 blocks from the plain pool
    assert bm.num_cached_blocks == 2
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]).num_tokens == 4


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    filled(bm, "a", [1, 2, 3, 4])
    running = filled(bm, "b", [7, 8, 9, 10, 11])
    bm.free("a")
    free_before = bm.num_free_blocks
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.num_free_blocks == free_before  # cached blocks became plain free ones
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == EMPTY_MATCH
    assert bm.block_table("b") == running and bm.num_allocated == 3  # in-use blocks untouched
    bm.check_invariants()
    bm.free("b")
    assert bm.num_allocated == 0
    bm.check_invariants()


# ---- CachePlan ----------------------------------------------------------------------------


def test_cache_plan_from_budget_fits() -> None:
    plan = CachePlan.from_budget(
        budget_bytes=4 * 2**20 + 100, block_size=16, bytes_per_token=1024, max_model_len=4096, budget_text="4MiB"
    )
    assert plan.bytes_per_block == 16 * 1024
    assert plan.num_blocks == 256
    assert plan.num_token_slots == 4096


def test_cache_plan_refuses_budget_too_small_for_one_request() -> None:
    with pytest.raises(ConfigError) as info:
        CachePlan.from_budget(
            budget_bytes=2**20,
            block_size=16,
            bytes_per_token=1024,
            max_model_len=4096,
            budget_text="kv_cache_memory=1MiB",
        )
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    for text in ("kv_cache_memory=1MiB", "64 blocks", "16 tokens", "max_model_len=4096", "256 blocks"):
        assert text in message, (text, message)
    # One block short is still refused; the exact amount is accepted.
    with pytest.raises(ConfigError):
        CachePlan.from_budget(255 * 16 * 1024, 16, 1024, 4096, "x")
    assert CachePlan.from_budget(256 * 16 * 1024, 16, 1024, 4096, "x").num_blocks == 256


# ---- stateful property test ---------------------------------------------------------------

REQUEST_IDS = ("r0", "r1", "r2", "r3", "r4")
# Prompts are a cut of one of a few shared "documents" plus a short random tail, so
# shared prefixes (and so prefix hits) are frequent.
DOCUMENTS = ([7] * 15, [1, 2, 3] * 5, [1, 2, 3, 4, 5] * 3)
TOKENS = st.builds(
    lambda doc, cut, tail: DOCUMENTS[doc][:cut] + tail,
    st.integers(0, len(DOCUMENTS) - 1),
    st.integers(0, 15),
    st.lists(st.integers(0, 9), max_size=4),
).filter(bool)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / register / free sequences over a few requests.

    Alongside the manager it keeps a fake KV store: what each block holds once a request
    "computed" its tokens. A prefix hit must only ever hand out blocks whose stored tokens
    are the ones asked for.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=3)
        self.tokens: dict[str, list[int]] = {}  # active request -> tokens it has room for
        self.shared: dict[str, int] = {}  # active request -> number of leading blocks from a prefix hit
        self.computed: dict[str, int] = {}  # active request -> tokens whose KV is written
        self.kv: dict[int, tuple[int, ...]] = {}

    def _available(self) -> int:
        return self.bm.num_blocks - self.bm.num_allocated

    @precondition(lambda self: len(self.tokens) < len(REQUEST_IDS))
    @rule(data=st.data(), tokens=TOKENS, use_prefix=st.booleans())
    def allocate(self, data: st.DataObject, tokens: list[int], use_prefix: bool) -> None:
        rid = data.draw(st.sampled_from([r for r in REQUEST_IDS if r not in self.tokens]))
        prefix = self.bm.find_cached_prefix(tokens) if use_prefix else EMPTY_MATCH
        bs = self.bm.block_size
        assert prefix.num_tokens == len(prefix.block_ids) * bs and prefix.num_tokens < len(tokens)
        for i, b in enumerate(prefix.block_ids):
            assert self.kv.get(b) == tuple(tokens[i * bs : (i + 1) * bs]), "prefix hit on a block with other KV"
        revived = sum(1 for b in prefix.block_ids if b not in self._in_use())
        need = self.bm.blocks_needed(len(tokens)) - len(prefix.block_ids) + revived
        fits = need <= self._available()
        assert self.bm.can_allocate(rid, len(tokens), prefix) == fits
        if fits:
            self.bm.allocate(rid, len(tokens), prefix)
            self.tokens[rid] = list(tokens)
            self.shared[rid] = len(prefix.block_ids)
            self.computed[rid] = prefix.num_tokens
        else:
            with pytest.raises(RuntimeError):
                self.bm.allocate(rid, len(tokens), prefix)
            assert self.bm.block_table(rid) == []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 9), min_size=1, max_size=8))
    def grow(self, data: st.DataObject, extra: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        table_before = list(self.bm.block_table(rid))
        total = len(self.tokens[rid]) + len(extra)
        fits = self.bm.blocks_needed(total) - len(table_before) <= self._available()
        assert self.bm.can_allocate(rid, total) == fits
        if fits:
            others = self._in_use() - set(table_before)
            new = self.bm.allocate(rid, total)
            assert self.bm.block_table(rid) == table_before + new
            assert len(set(new)) == len(new) and not set(new) & (others | set(table_before))
            self.tokens[rid] += extra

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """The model wrote KV for the first `known` tokens; register the full blocks."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid]
        known = data.draw(st.integers(self.computed[rid], len(tokens)))  # KV only ever grows
        self.computed[rid] = known
        bs = self.bm.block_size
        table = self.bm.block_table(rid)
        for i in range(self.shared[rid], self.bm.blocks_needed(known)):
            self.kv[table[i]] = tuple(tokens[i * bs : min((i + 1) * bs, known)])
        self.bm.register_full_blocks(rid, tokens, known)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        n = len(self.bm.block_table(rid))
        assert self.bm.free(rid) == n
        del self.tokens[rid], self.shared[rid], self.computed[rid]

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()
        assert self.bm.num_cached_blocks == 0

    def _in_use(self) -> set[int]:
        return {b for rid in self.tokens for b in self.bm.block_table(rid)}

    @invariant()
    def pools_add_up(self) -> None:
        bm = self.bm
        bm.check_invariants()
        allocated, cached, free = pools(bm)
        assert allocated + cached + free == bm.num_blocks
        assert allocated == len(self._in_use())
        for rid, tokens in self.tokens.items():
            assert len(bm.block_table(rid)) == bm.blocks_needed(len(tokens))
        if not self.tokens:
            assert bm.num_allocated == 0

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.bm.free(rid)
        assert self.bm.num_allocated == 0
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_free_behind_releases_only_blocks_wholly_behind_the_window() -> None:
    from conveyor.core.kv_cache import FREED_BLOCK

    blocks = BlockManager(num_blocks=16, block_size=4)
    blocks.allocate("a", 22)  # 6 blocks: positions 0-23
    table = list(blocks.block_table("a"))
    assert blocks.free_behind("a", 11) == 2  # blocks of positions 0-3 and 4-7; 8-11 still holds position 11
    assert blocks.block_table("a")[:3] == [FREED_BLOCK, FREED_BLOCK, table[2]]
    assert blocks.num_allocated == 4 and blocks.free_behind("a", 11) == 0
    blocks.fork("a", "b")  # a fork shares the live blocks only
    assert blocks.num_allocated == 4
    blocks.free_behind("a", 16, hold_until_step=3)  # held while step 3 may read them: still allocated
    assert blocks.num_allocated == 4
    blocks.check_invariants()
    assert blocks.free("a") == 2 and blocks.free("b") == 4
    blocks.release_held(3)
    assert blocks.num_allocated == 0
    blocks.check_invariants()
