"""PrefixAffinityRouter: which replica gets a request, so that shared prefixes hit one replica's KV cache.

A prompt's full KV blocks are hashed as a chain (block i's hash covers blocks 0..i, as the block manager's
prefix cache does). The router remembers, for recent chains, the replica it sent them to; a new request goes
to the replica holding its longest remembered chain, unless that replica's outstanding tokens exceed the
least-loaded replica's by more than `max_imbalance_tokens`; requests with no remembered prefix go to the
least-loaded replica. Outstanding tokens = prompt + max new tokens of every routed, unfinished request.

Pure Python (no torch, no Ray): the front process runs it and tells it when a request ends.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    replica: int
    matched_blocks: int
    """Full blocks of the prompt whose chain was last sent to this replica (0: routed by load alone)."""
    tokens: int
    """What the request adds to the replica's outstanding tokens until `finished`."""


class PrefixAffinityRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        max_prefix_blocks: int = 64,
        max_imbalance_tokens: int = 8192,
        remembered_chains: int = 100_000,
    ) -> None:
        for name, value in (
            ("num_replicas", num_replicas),
            ("block_size", block_size),
            ("max_prefix_blocks", max_prefix_blocks),
            ("remembered_chains", remembered_chains),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PrefixAffinityRouter: {name}={value!r} must be an integer >= 1")
        if not isinstance(max_imbalance_tokens, int) or max_imbalance_tokens < 0:
            raise ValueError(
                f"PrefixAffinityRouter: max_imbalance_tokens={max_imbalance_tokens!r} must be an integer >= 0"
            )
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.max_imbalance_tokens = max_imbalance_tokens
        self.outstanding = [0] * num_replicas
        """Outstanding tokens per replica."""
        self.routed = [0] * num_replicas
        """Requests routed to each replica so far (for metrics)."""
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # chain hash -> replica, least recently used first
        self._capacity = remembered_chains

    def chain_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """Hash of blocks 0..i for every full block i of the prompt (at most max_prefix_blocks)."""
        hashes: list[bytes] = []
        parent = b""
        full = min(len(prompt) // self.block_size, self.max_prefix_blocks)
        for i in range(full):
            block = prompt[i * self.block_size : (i + 1) * self.block_size]
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in block))
            parent = h.digest()
            hashes.append(parent)
        return hashes

    def route(self, prompt: Sequence[int], max_new_tokens: int, unavailable: Collection[int] = ()) -> Route:
        """The replica for this prompt, never one in `unavailable` (down, or already tried)."""
        hashes = self.chain_hashes(prompt)
        candidates = [r for r in range(len(self.outstanding)) if r not in unavailable]
        if not candidates:
            raise ValueError(f"PrefixAffinityRouter: all {len(self.outstanding)} replicas are unavailable")
        least = min(candidates, key=lambda r: (self.outstanding[r], self.routed[r]))
        replica, matched = least, 0
        for i in range(len(hashes) - 1, -1, -1):
            owner = self._owner.get(hashes[i])
            if owner is not None:
                if (
                    owner not in unavailable
                    and self.outstanding[owner] - self.outstanding[least] <= self.max_imbalance_tokens
                ):
                    replica, matched = owner, i + 1
                break
        for h in hashes:  # this replica now holds (or will hold) these blocks
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self._capacity:
            self._owner.popitem(last=False)
        tokens = len(prompt) + max(0, max_new_tokens)
        self.outstanding[replica] += tokens
        self.routed[replica] += 1
        return Route(replica, matched, tokens)

    def finished(self, route: Route) -> None:
        """The request ended (any way): its tokens no longer count against its replica."""
        self.outstanding[route.replica] -= route.tokens

    def forget_replica(self, replica: int) -> None:
        """A replica restarted with an empty cache: drop what it was thought to hold and its load."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]
        self.outstanding[replica] = 0
