"""PersistentBatch: the runner's copy of each running request's block table and penalty history.

A plan carries a request in full only when it is new to the runner (admitted, resumed after
preemption, forked); for the others it carries what changed since the last plan: the block table's
entries from the first one that changed (new blocks, a copy-on-write block, entries a sliding
window freed) and the penalty history's newly committed ids. Requests that finished, were aborted
or preempted leave through `StepPlan.dropped_ids`. So the host work per step follows what changed,
not the length of every context.

    scheduler (sent so far)           plan                          runner (PersistentBatch)
    table  [7, 2, 9]       ->  start=2, tail=[9, 4]       ->   [7, 2] + [9, 4] = [7, 2, 9, 4]
    history 130 ids        ->  start=130, tail=(t130,)    ->   131 ids (+ in-flight placeholders)

Every plan is applied in step order, on rank 0 and on every tensor-parallel worker alike, so a
replica that missed nothing equals a rebuild from the scheduler's state; a delta that does not fit
the copy held (a table shorter than `block_table_start`, a history of another length than
`history_start`) raises instead of computing with a stale copy. Plain Python, no torch.
"""

from __future__ import annotations

from array import array

from conveyor.core.plan import StepPlan


class PersistentBatch:
    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}
        self._histories: dict[str, array[int]] = {}
        """int64 arrays: the runner reads them as tensors without a copy per id (torch.frombuffer)."""

    def apply(self, plan: StepPlan) -> None:
        """Bring the copies up to `plan` (call once per plan, in step order, before reading them)."""
        for request_id in plan.dropped_ids:
            self._tables.pop(request_id, None)
            self._histories.pop(request_id, None)
        for seq in plan.seqs:
            rid = seq.request_id
            if seq.block_table_start == 0:
                self._tables[rid] = list(seq.block_table_tail)
            else:
                table = self._tables.get(rid)
                if table is None or len(table) < seq.block_table_start:
                    raise RuntimeError(
                        f"step {plan.step_id}: request {rid!r} keeps {seq.block_table_start} block table entries, "
                        f"but the runner holds {'none' if table is None else len(table)}; a plan was skipped or "
                        f"applied out of order"
                    )
                del table[seq.block_table_start :]
                table.extend(seq.block_table_tail)
            spec = seq.sampling
            if spec is None or spec.history_tail is None:
                continue
            if spec.history_start == 0:
                self._histories[rid] = array("q", spec.history_tail)
                continue
            history = self._histories.get(rid)
            if history is None or len(history) != spec.history_start:
                raise RuntimeError(
                    f"step {plan.step_id}: request {rid!r} continues its penalty history at {spec.history_start} "
                    f"ids, but the runner holds {'none' if history is None else len(history)}; a plan was skipped "
                    f"or applied out of order"
                )
            history.extend(spec.history_tail)

    def block_table(self, request_id: str) -> list[int]:
        """The request's whole block table as of the last plan applied (empty when unknown)."""
        return self._tables.get(request_id, [])

    def history(self, request_id: str) -> array[int]:
        """The request's known token ids (prompt + committed outputs) as of the last plan applied, for
        a request with a penalty (empty when unknown). Read it before the next `apply` and keep no view
        of it past then (a view exported from it would stop it growing)."""
        return self._histories.get(request_id, array("q"))

    @property
    def request_ids(self) -> set[str]:
        return set(self._tables) | set(self._histories)
