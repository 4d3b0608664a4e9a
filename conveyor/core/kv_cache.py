"""BlockManager: KV-cache block ids, refcounts and prefix-cache hashes (no torch).

Every block is in exactly one of three pools:

    allocated  refcount > 0, in some request's block table (or held: freed while an
               in-flight step may still read it)
    cached     refcount == 0, holds a full block whose hash is known; reusable by a
               prefix hit, evicted least-recently-freed first when a new block is needed
    free       refcount == 0, no hash

so allocated + cached + free == num_blocks at all times (`check_invariants`).

Prefix hashes chain: hash(block i) = H(hash(block i-1), tokens of block i). A hash hit is
re-checked against the block's stored token ids before it is used.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from conveyor.errors import ConfigError

FREED_BLOCK = -1
"""A block-table entry whose block was released while the request runs: every layer's sliding window has
moved past all of its positions (`free_behind`). Such entries are always a prefix of the table."""


class PrefixMatch(NamedTuple):
    block_ids: list[int]
    num_tokens: int


EMPTY_MATCH = PrefixMatch([], 0)


@dataclass(frozen=True)
class CachePlan:
    """How many KV blocks fit in a memory budget; discovered at start-up."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def from_budget(
        cls, budget_bytes: int, block_size: int, bytes_per_token: int, max_model_len: int, budget_text: str
    ) -> CachePlan:
        bytes_per_block = block_size * bytes_per_token
        num_blocks = budget_bytes // bytes_per_block
        needed = -(-max_model_len // block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"the KV cache budget of {budget_text} ({budget_bytes / 2**20:.1f} MiB) holds {num_blocks} "
                f"blocks of {block_size} tokens ({bytes_per_block / 2**10:.1f} KiB each), but one request of "
                f"max_model_len={max_model_len} tokens needs {needed} blocks "
                f"({needed * bytes_per_block / 2**20:.1f} MiB); raise kv_cache_memory or lower max_model_len"
            )
        return cls(num_blocks=num_blocks, block_size=block_size, bytes_per_block=bytes_per_block)


def _block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount 0 with a hash, LRU first
        self._hash_of_block: dict[int, bytes] = {}
        self._tokens_of_block: dict[int, tuple[int, ...]] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # hashes of a request's full blocks, in order
        self._held: list[tuple[int, list[int]]] = []  # (step id, table) freed while that step may read them
        self.num_allocated = 0
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- queries --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: free plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_allocated / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest run of cached full blocks that prefix `token_ids`, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return EMPTY_MATCH
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        parent, found = b"", []
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = _block_hash(parent, tokens)
            block = self._block_of_hash.get(parent)
            if block is None or self._tokens_of_block.get(block) != tokens:
                break
            found.append(block)
        return PrefixMatch(found, len(found) * bs)

    def holds_privately(self, request_id: str, num_tokens: int, write_from: int) -> bool:
        """Whether the request's table already holds `num_tokens` tokens and the block at `write_from`
        is its own: then writing [write_from, num_tokens) needs no block (the common decode step)."""
        table = self._tables.get(request_id)
        if table is None or self.blocks_needed(num_tokens) > len(table):
            return False
        return self._shared_block_at(request_id, write_from) is None

    def new_blocks_needed(self, request_id: str, num_tokens: int, prefix_blocks: int = 0) -> int:
        """Fresh blocks the request's table (plus a prefix of `prefix_blocks` cached blocks) needs to hold
        `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ())) + prefix_blocks
        return max(0, self.blocks_needed(num_tokens) - have)

    def can_allocate(
        self, request_id: str, num_tokens: int, prefix: PrefixMatch = EMPTY_MATCH, write_from: int | None = None
    ) -> bool:
        """Whether the request's table can grow to hold `num_tokens` tokens (plus a private copy
        of a shared block at position `write_from`, when given)."""
        new = self.new_blocks_needed(request_id, num_tokens, len(prefix.block_ids))
        revived = sum(1 for b in prefix.block_ids if self._refcount[b] == 0)
        copy = 1 if write_from is not None and self._shared_block_at(request_id, write_from) is not None else 0
        return new + revived + copy <= self.num_free_blocks

    # ---- verbs ----------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, prefix: PrefixMatch = EMPTY_MATCH) -> list[int]:
        """Grow the request's table to hold `num_tokens` tokens; a prefix only for a new table."""
        if not self.can_allocate(request_id, num_tokens, prefix):
            raise RuntimeError(f"allocate({request_id!r}, {num_tokens}) without room: call can_allocate first")
        table = self._tables.setdefault(request_id, [])
        if prefix.block_ids:
            if table:
                raise RuntimeError(f"request {request_id!r} already has blocks; a prefix hit is for a new one")
            for b in prefix.block_ids:
                self._take(b)
            table.extend(prefix.block_ids)
            self._hashes[request_id] = [self._hash_of_block[b] for b in prefix.block_ids]
            self.prefix_hit_tokens += prefix.num_tokens
        new_blocks = [self._take_new() for _ in range(self.blocks_needed(num_tokens) - len(table))]
        table.extend(new_blocks)
        return new_blocks

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's blocks, shared (refcounts up), e.g. for n > 1 samples."""
        if child_id in self._tables:
            raise RuntimeError(f"request {child_id!r} already has blocks; cannot fork into it")
        table = list(self._tables[parent_id])
        for b in table:
            if b != FREED_BLOCK:
                self._refcount[b] += 1
        self._tables[child_id] = table
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))

    def copy_on_write(self, request_id: str, position: int) -> tuple[int, int] | None:
        """Before writing `position`: if its block is shared, swap in a private block and
        return (source, destination) for the device to copy; else None."""
        index = self._shared_block_at(request_id, position)
        if index is None:
            return None
        table = self._tables[request_id]
        shared = table[index]
        private = self._take_new()
        self._refcount[shared] -= 1
        table[index] = private
        return shared, private

    def _shared_block_at(self, request_id: str, position: int) -> int | None:
        table = self._tables.get(request_id, [])
        index = position // self.block_size
        return (
            index if index < len(table) and table[index] != FREED_BLOCK and self._refcount[table[index]] > 1 else None
        )

    def count_prefix_query(self, num_prompt_tokens: int) -> None:
        self.prefix_queries_tokens += num_prompt_tokens

    def register_full_blocks(self, request_id: str, token_ids: Sequence[int], num_known_tokens: int) -> None:
        """Hash the request's blocks that `num_known_tokens` tokens fill completely."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id, [])
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hashes) < min(num_known_tokens // bs, len(table)):
            i = len(hashes)
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = _block_hash(hashes[-1] if hashes else b"", tokens)
            hashes.append(h)
            block = table[i]
            if block != FREED_BLOCK and h not in self._block_of_hash and block not in self._hash_of_block:
                self._block_of_hash[h] = block
                self._hash_of_block[block] = h
                self._tokens_of_block[block] = tokens

    def free(self, request_id: str, hold_until_step: int | None = None) -> int:
        """Release the request's blocks; returns how many it held. Unknown ids free nothing.

        With `hold_until_step`, the blocks leave the request now but return to the pools only
        at `release_held(step)` for a step >= it: a step still in flight may read them.
        """
        table = [b for b in self._tables.pop(request_id, []) if b != FREED_BLOCK]
        self._hashes.pop(request_id, None)
        self._hold_or_release(table, hold_until_step)
        return len(table)

    def free_behind(self, request_id: str, first_needed_position: int, hold_until_step: int | None = None) -> int:
        """Release the request's blocks whose positions all lie before `first_needed_position` (no query of
        this or a later step attends to them: a sliding window has passed them); their table entries become
        FREED_BLOCK. Held like `free` while an in-flight step may still read them. Returns how many."""
        table = self._tables.get(request_id, [])
        released = []
        for i in range(min(max(first_needed_position, 0) // self.block_size, len(table))):
            if table[i] != FREED_BLOCK:
                released.append(table[i])
                table[i] = FREED_BLOCK
        self._hold_or_release(released, hold_until_step)
        return len(released)

    def _hold_or_release(self, blocks: list[int], hold_until_step: int | None) -> None:
        if hold_until_step is not None and blocks:
            self._held.append((hold_until_step, blocks))
        else:
            self._release(blocks)

    def release_held(self, completed_step: int) -> None:
        """Return blocks held for steps up to `completed_step` (that step has finished)."""
        keep = []
        for step, table in self._held:
            if step <= completed_step:
                self._release(table)
            else:
                keep.append((step, table))
        self._held = keep

    @property
    def num_held_blocks(self) -> int:
        return sum(len(t) for _, t in self._held)

    def _release(self, table: list[int]) -> None:
        for b in reversed(table):  # tail blocks first, so they are evicted first
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self.num_allocated -= 1
                if b in self._hash_of_block:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def reset_prefix_cache(self) -> None:
        for b in list(self._cached):
            self._forget_hash(b)
            self._free.append(b)
        self._cached.clear()

    # ---- internals ------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self._refcount[block] == 0:
            self._cached.pop(block, None)
            self.num_allocated += 1
        self._refcount[block] += 1

    def _take_new(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)  # evict the least recently freed
            self._forget_hash(block)
        self._refcount[block] = 1
        self.num_allocated += 1
        return block

    def _forget_hash(self, block: int) -> None:
        h = self._hash_of_block.pop(block, None)
        self._tokens_of_block.pop(block, None)
        if h is not None and self._block_of_hash.get(h) == block:
            del self._block_of_hash[h]

    def check_invariants(self) -> None:
        """Raise AssertionError when the pools disagree (used by tests and idle checks)."""
        allocated = sum(1 for r in self._refcount if r > 0)
        assert allocated == self.num_allocated, (allocated, self.num_allocated)
        assert allocated + len(self._cached) + len(self._free) == self.num_blocks, (
            allocated,
            len(self._cached),
            len(self._free),
            self.num_blocks,
        )
        assert all(r >= 0 for r in self._refcount)
        assert all(self._refcount[b] == 0 and b in self._hash_of_block for b in self._cached)
        assert all(self._refcount[b] == 0 and b not in self._hash_of_block for b in self._free)
        in_tables: dict[int, int] = {}
        for table in [*self._tables.values(), *(t for _, t in self._held)]:
            for b in table:
                if b == FREED_BLOCK:
                    continue
                in_tables[b] = in_tables.get(b, 0) + 1
        assert all(self._refcount[b] == n for b, n in in_tables.items()), "refcounts disagree with tables"
        assert allocated == len(in_tables)
