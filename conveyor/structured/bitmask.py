"""Token bitmasks as tensors: a step's mask, which may be filled after the step was prepared, and
applying it to logits.

Under async batching the host prepares step N+1 while step N runs, so N+1's masks cannot be
known then (they depend on N's tokens). The prepared step carries a DeferredBitmask instead,
completed as soon as step N is committed, and the forward of N+1 waits for it only when it
reaches sampling (vLLM's order: forward first, grammar mask at sampling time). On CUDA the host
fills it then; on CPU it gets a filler that the sampling thread runs (engine/grammars.py says why).

    bitmask [rows, words] int32, words = ceil(vocab / 32): token t of row r is allowed
    iff bit (t % 32) of bitmask[r, t // 32] is set.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch

BITS = 32

MaskInPlace = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""(logits [batch, vocab], rows [k] int64, bitmask [k, words] int32) -> None: the native kernel
(csrc/token_bitmask.cpp) that writes -inf over the forbidden tokens in place."""


class GrammarKernels(Protocol):
    """The native CPU kernels of csrc/token_bitmask.cpp (conveyor.model.native.NativeKernels has them)."""

    def apply_token_bitmask_(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Every token mask i forbids set to -inf in logits row rows[i], in place."""

    def argmax_allowed(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """[k] int64: row rows[i]'s first largest logit among the tokens mask i allows (0 if it allows none)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


MaskFiller = Callable[[], torch.Tensor]
"""Computes a step's [rows, words] int32 masks; called once, on the thread that samples the step."""


class DeferredBitmask:
    """The grammar masks of one step's constrained rows: `rows` are indices into the step's
    sampled rows; the [len(rows), words] int32 mask arrives through set() (from any thread), or
    set_filler() hands over the computation itself, which wait() then runs on the sampling thread."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self._future: Future[torch.Tensor | MaskFiller] = Future()

    def set(self, bitmask: torch.Tensor) -> None:
        self._future.set_result(bitmask)

    def set_filler(self, fill: MaskFiller) -> None:
        """The rows' grammar states are final: `fill` computes their masks when the step samples (on a CPU
        device that thread owns the cores then, so the masks are made in parallel instead of on a host thread
        that competes with the forward for them)."""
        self._future.set_result(fill)

    def fail(self, error: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(error)

    @property
    def is_set(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        """The masks (computed now, on this thread, when a filler was set); call it once."""
        value = self._future.result(timeout=timeout_s)
        return value if isinstance(value, torch.Tensor) else value()


_BYTE_PENALTY: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_penalty(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: entry (b, i) is 0 when bit i of byte b is set, else -inf."""
    key = (device, dtype)
    if key not in _BYTE_PENALTY:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # [256, 8]
        _BYTE_PENALTY[key] = torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)
    return _BYTE_PENALTY[key]


def bitmask_penalty(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab]: 0 where a token is allowed, -inf where it is not.

    One table lookup per byte of the mask (bit i of byte j of word w is token 32w + 8j + i on a
    little-endian machine, which torch's CPUs and GPUs all are): a quarter of the ops of shifting out
    each of the 32 bits and masking."""
    table = _byte_penalty(bitmask.device, dtype)
    as_bytes = bitmask.contiguous().view(torch.uint8).int()  # [rows, words * 4]
    return table[as_bytes].flatten(1)[:, :vocab_size]  # [rows, vocab]


def native_applies(logits: torch.Tensor) -> bool:
    """Whether the native kernels take these logits: on the CPU, float32 or bfloat16, [batch, vocab] with
    contiguous rows."""
    return (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.dim() == 2
        and logits.stride(-1) == 1
    )


def apply_bitmask(
    logits: torch.Tensor,
    rows: torch.Tensor,
    bitmask: torch.Tensor,
    native: MaskInPlace | None = None,
    owned: bool = False,
) -> torch.Tensor:
    """logits [batch, vocab] float; rows [k] int64 (distinct); bitmask [k, words] int32 -> logits with every
    token a row's grammar forbids at -inf (other rows unchanged).

    With `native` (CPU, float32 / bfloat16 logits) the kernel writes the -inf in place: into `logits`
    itself when the caller `owned` it (a tensor nobody else reads), else into a copy. Otherwise torch's
    ops build a [k, vocab] penalty and add it (the same result)."""
    if native is not None and native_applies(logits):
        out = logits if owned else logits.clone()
        native(out, rows.to(torch.int64).contiguous(), bitmask.contiguous())
        return out
    penalty = bitmask_penalty(bitmask, logits.shape[-1], logits.dtype)  # [k, vocab]
    if rows.shape[0] == logits.shape[0]:  # every row constrained (rows are 0..k-1 in order)
        return logits + penalty
    return logits.index_add(0, rows, penalty)
