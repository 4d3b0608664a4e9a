"""Rotary position embedding: inverse frequencies for each supported scaling type, and the cos/sin tables.

Scaling types (the names transformers and llama.cpp use):
  default  inv_freq[i] = theta ** (-2i / head_dim)
  linear   inv_freq / factor                      (positions interpolated)
  llama3   long wavelengths / factor, short kept, a smooth band between (Llama 3.1+)
  yarn     interpolated and extrapolated frequencies blended by a linear ramp over the
           dimensions, cos/sin scaled by an attention factor (Qwen2.5 long context, ...)
A GGUF file may instead carry per-frequency divisors (the `rope_freqs` tensor: how llama.cpp's
converter stores llama3 scaling); they divide the default frequencies.
"""

from __future__ import annotations

import math

import torch

from conveyor.model.spec import RopeSpec

ROPE_SCALING_TYPES = ("default", "linear", "llama3", "yarn")
"""Every scaling type Conveyor computes; anything else is refused by name at load."""


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies with the spec's scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [head_dim // 2]
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.freq_factors is not None:
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        return _llama3(inv_freq, rope)
    if rope.scaling_type == "yarn":
        return _yarn(rope, head_dim)
    if rope.scaling_type != "default":
        raise ValueError(f"rope scaling type {rope.scaling_type!r} is not one of {ROPE_SCALING_TYPES}")
    return inv_freq


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
        inv_freq = rope_inv_freq(rope, head_dim)  # [head_dim // 2]
        positions = torch.arange(max_positions, dtype=torch.int64).float()  # [max_positions]
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos = (angles.cos() * rope.attention_factor).to(device)  # [max_positions, head_dim] float32
        self.sin = (angles.sin() * rope.attention_factor).to(device)  # [max_positions, head_dim] float32

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [tokens] -> cos, sin [tokens, 1, head_dim] in dtype (computed once per step)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
