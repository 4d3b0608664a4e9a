"""Vectorized per-request sampling: one pass over the batch, whatever each row asks for.

Randomness is counter-based: the noise for (request seed, output index, vocab id) is a
hash of those three numbers, computed with integer tensor ops. A row's draw therefore
depends on its seed and position only — never on the other rows of the batch, on the
step it lands in, on async vs sync execution, or on the device — and needs no
per-request generator object or Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, without int64 overflow (split c in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection with full avalanche (values in int64)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, output_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, output_index: [rows] int64 -> [rows, vocab] float32 uniform in (0, 1)."""
    hi = _fmix32(((seeds >> 32) & _MASK32) ^ 0x9E3779B9)
    key = _fmix32((seeds & _MASK32) ^ hi)
    key = _fmix32(key ^ _fmix32((output_index & _MASK32) ^ 0x7F4A7C15))  # [rows]
    vocab = _fmix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) ^ 0x165667B1)  # [vocab]
    bits = _fmix32(_fmix32(key[:, None] ^ vocab[None, :]) ^ key[:, None])  # [rows, vocab]
    # 23 bits, so that (k + 0.5) / 2**23 is exact in float32 and never rounds to 0 or 1
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [rows] float32; 0 = greedy
    top_k: torch.Tensor  # [rows] int64; <= 0 = off
    top_p: torch.Tensor  # [rows] float32; 1.0 = off
    seeds: torch.Tensor  # [rows] int64
    output_index: torch.Tensor  # [rows] int64
    all_greedy: bool
    any_top_k_or_p: bool


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab] -> same, with tokens outside each row's top-k / nucleus set to -inf.

    Semantics of transformers' TopKLogitsWarper then TopPLogitsWarper: top-k keeps every
    token tied with the k-th largest; top-p drops the smallest tokens whose cumulative
    probability stays <= 1 - top_p, always keeping the most likely one.
    """
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)  # [rows, vocab] each
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))  # [rows]
    kth_largest = ascending.gather(1, (vocab - k).unsqueeze(1))  # [rows, 1]
    ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [rows, vocab]
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)  # [rows, vocab]
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits: [rows, vocab] float32 -> sampled token ids [rows] int64. Greedy rows are exact argmax."""
    greedy = logits.argmax(dim=-1)  # [rows]
    if t.all_greedy:
        return greedy
    is_greedy = t.temperature == 0  # [rows]
    temperature = torch.where(is_greedy, torch.ones_like(t.temperature), t.temperature)
    scaled = logits / temperature.unsqueeze(1)  # [rows, vocab]
    if t.any_top_k_or_p:
        scaled = apply_top_k_top_p(scaled, t.top_k, t.top_p)
    u = uniform_noise(t.seeds, t.output_index, logits.shape[-1])  # [rows, vocab]
    gumbel = -torch.log(-torch.log(u))  # [rows, vocab]; argmax(logits + gumbel) ~ softmax(logits)
    sampled = (scaled + gumbel).argmax(dim=-1)  # [rows]
    return torch.where(is_greedy, greedy, sampled)
