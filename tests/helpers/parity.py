"""Token-for-token comparison against transformers' greedy generate, with near-tie accounting."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

TIE_GAP = 1e-4


@dataclass
class Reference:
    token_ids: list[int]
    top2_gap: list[float]
    """Per generated position: reference's top-1 minus top-2 logit."""


@contextmanager
def reference_threads() -> Iterator[None]:
    """Run the transformers reference on one thread. Its hundreds of small ops per token each fork and join
    torch's OpenMP team; on a shared or busy machine every join waits for a descheduled thread, and the reference
    ran 7x slower on 2 threads than on 1 (0.5 against 3.7 s per token at load 6) and dominated the suite's time.
    The reference's tokens do not depend on its thread count; the engine under test keeps its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Reference]:
    """transformers generate, one prompt at a time (no padding), EOS disabled."""
    refs = []
    for ids in prompts:
        with torch.no_grad(), reference_threads():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=-1,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        logits = torch.stack(out.logits, dim=1)[0].float()  # [new_tokens, vocab]
        top2 = logits.topk(2, dim=-1).values  # [new_tokens, 2]
        refs.append(Reference(out.sequences[0, len(ids) :].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return refs


def compare(refs: list[Reference], got: list[list[int]], allow_ties: bool, tie_gap: float = TIE_GAP) -> int:
    """Assert equality; returns how many sequences diverged exactly at a reference near-tie
    (only when allow_ties). Any other difference fails with the first mismatch shown."""
    ties = 0
    for i, (ref, ours) in enumerate(zip(refs, got)):
        n = min(len(ref.token_ids), len(ours))
        assert len(ours) == len(ref.token_ids), f"prompt {i}: {len(ours)} tokens, reference {len(ref.token_ids)}"
        mismatch = next((j for j in range(n) if ref.token_ids[j] != ours[j]), None)
        if mismatch is None:
            continue
        if allow_ties and ref.top2_gap[mismatch] < tie_gap:
            ties += 1
            continue
        raise AssertionError(
            f"prompt {i} diverges at generated token {mismatch}: ours {ours[mismatch]}, "
            f"reference {ref.token_ids[mismatch]} (reference top-2 gap "
            f"{ref.top2_gap[mismatch]:.3g})\nours {ours}\nref  {ref.token_ids}"
        )
    return ties


def teacher_forced_logits(model: Any, prompts: list[list[int]], got: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits at each generated position of prompt + our continuation, one forward pass per
    sequence: -> per sequence [len(continuation), vocab], row j predicting continuation token j."""
    out = []
    for ids, ours in zip(prompts, got, strict=True):
        with torch.no_grad():  # whole-sequence products: large enough for torch's threads to pay (unlike generate)
            out.append(model(torch.tensor([ids + ours])).logits[0, len(ids) - 1 : -1].float())  # [new, vocab]
    return out


def check_greedy_logits(
    reference_logits: list[torch.Tensor], got: list[list[int]], allow_ties: bool, tie_gap: float = TIE_GAP
) -> int:
    """Every token of our continuations is the reference's argmax at its position (teacher_forced_logits), or, with
    allow_ties, one whose reference logit is within tie_gap of the argmax's (a near tie, counted; the check goes on
    past it, on our prefix). Returns the near ties."""
    ties = 0
    for i, (logits, ours) in enumerate(zip(reference_logits, got, strict=True)):
        best = logits.argmax(-1).tolist()  # [new_tokens]
        for j, token in enumerate(ours):
            if token == best[j]:
                continue
            gap = (logits[j, best[j]] - logits[j, token]).item()
            if allow_ties and gap < tie_gap:
                ties += 1
                continue
            raise AssertionError(
                f"prompt {i} diverges at generated token {j}: ours {token}, reference {best[j]} (reference logit "
                f"gap {gap:.3g})\nours {ours}"
            )
    return ties


def check_teacher_forced(
    model: Any,
    prompts: list[list[int]],
    got: list[list[int]],
    new_tokens: int,
    allow_ties: bool,
    tie_gap: float = TIE_GAP,
) -> int:
    """Greedy parity checked with one transformers forward pass per sequence, over the prompt and our continuation:
    at every generated position our token must be transformers' argmax given the same prefix, the token its greedy
    generate would choose there, so by induction over the positions the continuation is transformers' greedy one.
    With allow_ties, a token whose reference logit is within tie_gap of the argmax's is accepted as a near tie (the
    reference's own greedy generate and its whole-sequence pass differ by rounding there); the check goes on past
    it, on our prefix. One pass per sequence instead of one generate step per token. Returns the near ties."""
    for i, ours in enumerate(got):
        assert len(ours) == new_tokens, f"prompt {i}: {len(ours)} tokens, asked for {new_tokens}"
    return check_greedy_logits(teacher_forced_logits(model, prompts, got), got, allow_ties, tie_gap)
