"""The collectives a tensor-parallel rank's forward needs, over one torch.distributed gloo group.

Each process builds its group from a TCPStore (rank 0 hosts it) and calls the ProcessGroup object directly,
so no process-global default group is set and an engine may start, stop and start again in one process.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F

COLLECTIVE_TIMEOUT_S = 300.0
"""Longest one collective waits for the other ranks (a rank that died turns into an error, not a hang)."""


class TensorParallelGroup:
    """Rank `rank` of `size`: sums partial outputs, assembles vocab-parallel lookups and logits."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        vocab_start: int,
        vocab_end: int,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.size = size
        self.vocab_start = vocab_start
        self.vocab_end = vocab_end
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("tp", store), rank, size, datetime.timedelta(seconds=timeout_s)
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (row-parallel O and down projections), in place."""
        x = x.contiguous()
        # torch's stubs declare the collectives on ProcessGroup only, not on ProcessGroupGloo (which has them)
        self.group.allreduce([x]).wait()  # type: ignore[attr-defined]  # see above
        return x

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """input_ids: [tokens]; table: this rank's rows [vocab / N, hidden] -> full embeddings [tokens, hidden]."""
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [tokens]
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        h = F.embedding(local, table) * mine.unsqueeze(-1).to(table.dtype)  # [tokens, hidden], zero where not ours
        return self.all_reduce(h)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [rows, vocab / N] -> [rows, vocab], every rank's slice in rank order."""
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.group.allgather([parts], [logits]).wait()  # type: ignore[attr-defined]  # not in the stubs: see all_reduce
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        self.group = None  # type: ignore[assignment]  # its sockets close with it
