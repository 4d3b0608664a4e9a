"""Rotary position embedding: inverse frequencies for each supported scaling type, and the cos/sin tables.

Scaling types (the names transformers and llama.cpp use):
  default  inv_freq[i] = theta ** (-2i / head_dim)
  linear   inv_freq / factor                      (positions interpolated)
  llama3   long wavelengths / factor, short kept, a smooth band between (Llama 3.1+)
  yarn     interpolated and extrapolated frequencies blended by a linear ramp over the
           dimensions, cos/sin scaled by an attention factor (Qwen2.5 long context, ...)
  longrope per-frequency divisors, one set for contexts up to the original length and one for longer
           ones, cos/sin scaled by an attention factor (Phi-3 128k, Phi-3.5, Phi-4-mini; "su" before)
A GGUF file may instead carry per-frequency divisors (the `rope_freqs` tensor: how llama.cpp's
converter stores llama3 scaling); they divide the default frequencies.

longrope in a paged engine: transformers picks the set by the length of each sequence so far and, when a
sequence first grows past the original length, recomputes its whole cache with the long set. Conveyor picks
one set per engine, as vLLM and llama.cpp do: the long set when max_model_len exceeds the original length,
else the short one, so cached keys (and shared prefix blocks) never change meaning mid-request. The tokens
equal transformers' wherever transformers uses the same set: sequences that stay within the original length
under a max_model_len at most that long, and prompts already longer than it under a larger max_model_len.

Partial rotary (Phi-4-mini: the first rotary_dim dimensions of each head rotate, rotate-half over them, the
rest pass through): the loader reorders each Q and K head's dimensions (`partial_rotary_order`) so that the
rotating pairs (i, i + rotary_dim / 2) sit at (i, i + head_dim / 2) and the passing dimensions get angle 0
and factor 1; q . k is unchanged by a reordering applied to both, so one full-head rotate-half (and the
native kernel) serves it.
"""

from __future__ import annotations

import math

import torch

from conveyor.model.model_spec import RopeSpec

ROPE_SCALING_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
"""Every scaling type Conveyor computes; anything else is refused by name at load."""


def rope_inv_freq(rope: RopeSpec, head_dim: int, max_positions: int) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies with the spec's scaling applied; with partial rotary, the first
    rotary_dim // 2 are the rotating pairs' and the rest 0 (see partial_rotary_order)."""
    dim = rope.rotary_dim or head_dim
    inv_freq = _inv_freq(rope, dim, max_positions)  # [dim // 2]
    return torch.cat([inv_freq, inv_freq.new_zeros((head_dim - dim) // 2)])  # [head_dim // 2]


def _inv_freq(rope: RopeSpec, dim: int, max_positions: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim // 2]
    if rope.freq_factors is not None:
        return (1.0 / (rope.theta**exponents)) / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.scaling_type == "linear":
        return (1.0 / (rope.theta**exponents)) / rope.factor
    if rope.scaling_type == "llama3":
        return _llama3(1.0 / (rope.theta**exponents), rope)
    if rope.scaling_type == "yarn":
        return _yarn(rope, dim)
    if rope.scaling_type == "longrope":
        factors = longrope_factors(rope, max_positions)
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    if rope.scaling_type != "default":
        raise ValueError(f"rope scaling type {rope.scaling_type!r} is not one of {ROPE_SCALING_TYPES}")
    return 1.0 / (rope.theta**exponents)


def longrope_factors(rope: RopeSpec, max_positions: int) -> tuple[float, ...]:
    """The long set when the engine's context exceeds the original one, else the short set (module docstring)."""
    assert rope.short_factors is not None and rope.long_factors is not None
    return rope.long_factors if max_positions > rope.original_max_position_embeddings else rope.short_factors


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] new dimension j of a head -> the old dimension it takes: the rotating halves [0, r/2) and
    [r/2, r) go to the fronts of the two halves of the head, the passing dimensions [r, head_dim) fill the rest."""
    half, rot_half, pass_half = head_dim // 2, rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(rot_half)) + list(range(rotary_dim, rotary_dim + pass_half))
    second = list(range(rot_half, rotary_dim)) + list(range(rotary_dim + pass_half, head_dim))
    assert len(first) == len(second) == half
    return torch.tensor(first + second, dtype=torch.int64)


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Frequencies with wavelengths longer than the original context are slowed by `factor`, short ones are
    kept, and the band between is interpolated smoothly."""
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    long_wave = old_len / rope.low_freq_factor
    short_wave = old_len / rope.high_freq_factor
    scaled = torch.where(wavelen > long_wave, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= short_wave) & (wavelen <= long_wave)
    return torch.where(in_band, blended, scaled)


def _yarn(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those that turn more than beta_fast times are kept, a linear ramp between."""
    base, dim = rope.theta, head_dim
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # [dim // 2]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim // 2]
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """The cos/sin multiplier YaRN uses when a config names none (0.1 ln(factor) + 1, or DeepSeek's ratio)."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


class RotaryEmbedding:
    """Rotate-half rotary embedding with a precomputed cos/sin table per position."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, device: torch.device) -> None:
        inv_freq = rope_inv_freq(rope, head_dim, max_positions)  # [head_dim // 2]
        positions = torch.arange(max_positions, dtype=torch.int64).float()  # [max_positions]
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        rotating = (rope.rotary_dim or head_dim) // 2
        factor = torch.ones(head_dim // 2)  # [head_dim // 2]: the attention factor scales rotating pairs only
        factor[:rotating] = rope.attention_factor
        half = head_dim // 2
        tables = []
        for function in (torch.cos, torch.sin):  # each half of the table is f(freqs) * factor: no [P, head_dim] temps
            table = torch.empty(max_positions, head_dim)  # [max_positions, head_dim] float32
            torch.mul(function(freqs), factor, out=table[:, :half])
            table[:, half:] = table[:, :half]
            tables.append(table.to(device))
        self.cos, self.sin = tables  # [max_positions, head_dim] float32 each

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [tokens] -> cos, sin [tokens, 1, head_dim] in dtype (computed once per step)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
