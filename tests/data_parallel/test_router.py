"""PrefixAffinityRouter: shared prefixes land on one replica, load spreads the rest, imbalance is bounded."""

from __future__ import annotations

import random

import pytest

from conveyor.data_parallel.router import PrefixAffinityRouter


def test_requests_sharing_a_256_token_prefix_go_to_one_replica_and_others_spread() -> None:
    rng = random.Random(0)
    router = PrefixAffinityRouter(num_replicas=2, block_size=16)
    prefix = [rng.randrange(50000) for _ in range(256)]
    shared = [router.route(prefix + [rng.randrange(50000) for _ in range(rng.randrange(0, 40))], 32) for _ in range(12)]
    assert len({r.replica for r in shared}) == 1
    assert all(r.matched_blocks == 16 for r in shared[1:])  # the whole 256-token prefix, every time after the first
    for r in shared:
        router.finished(r)
    unrelated = [router.route([rng.randrange(50000) for _ in range(100)], 32) for _ in range(10)]
    assert sorted(r.replica for r in unrelated).count(0) == 5  # by load alone: alternating
    assert all(r.matched_blocks == 0 for r in unrelated)


def test_affinity_yields_to_load_beyond_the_imbalance_limit() -> None:
    router = PrefixAffinityRouter(num_replicas=2, block_size=4, max_imbalance_tokens=60)
    prompt = list(range(40))
    first = router.route(prompt, 10)  # 50 tokens on one replica
    assert router.route(prompt, 10).replica == first.replica  # 50 - 0 <= 60: still
    third = router.route(prompt, 10)  # 100 - 0 > 60: the other one
    assert third.replica != first.replica and third.matched_blocks == 0
    assert router.outstanding[first.replica] == 100 and router.outstanding[third.replica] == 50


def test_partial_blocks_are_not_hashed_and_chains_cover_their_whole_prefix() -> None:
    router = PrefixAffinityRouter(num_replicas=3, block_size=4)
    assert router.chain_hashes([1, 2, 3]) == []
    a, b = router.chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]), router.chain_hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[1] != b[1]  # same second block, different first: different chains


def test_forget_replica_and_bad_settings() -> None:
    router = PrefixAffinityRouter(num_replicas=2, block_size=4)
    r = router.route(list(range(16)), 4)
    router.forget_replica(r.replica)
    assert router.outstanding[r.replica] == 0 and router.route(list(range(16)), 4).matched_blocks == 0
    with pytest.raises(ValueError, match="num_replicas=0"):
        PrefixAffinityRouter(num_replicas=0, block_size=16)
