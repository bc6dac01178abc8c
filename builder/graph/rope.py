"""Rotary position tables, computed as transformers computes them (float32, non-interleaved halves)."""

from __future__ import annotations

import math

import numpy as np

from camshaft.errors import CheckpointError
from camshaft.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> np.ndarray:
    """`head_dim`: the rotated dimensions (ModelConfig.rotary_dim); `long`: LongRoPE's frequencies past the original
    context (else its short ones)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    if rope.type == "longrope":
        factors = np.asarray(rope.long_factor if long else rope.short_factor, dtype=np.float32)
        return (1.0 / (factors * np.float32(rope.theta) ** exponents)).astype(np.float32)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if rope.type == "yarn":
        return _yarn(rope, head_dim)
    return inv_freq


def _yarn(rope: RopeConfig, dim: int) -> np.ndarray:
    """Frequencies extrapolated above the ramp and interpolated (divided by the factor) below it (YaRN)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolate = (1 - ramp).astype(np.float32)
    pos_freqs = (np.float32(rope.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(
        np.float32)
    interpolated = (1.0 / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)
    extrapolated = (1.0 / pos_freqs).astype(np.float32)
    return (interpolated * (1 - extrapolate) + extrapolated * extrapolate).astype(np.float32)


def cos_sin_tables(rope: RopeConfig, head_dim: int, max_positions: int,
                   long: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """[max_positions, head_dim / 2] cosine and sine tables (times yarn's and longrope's attention factor, as
    transformers); `long`: LongRoPE's long factors."""
    positions = np.arange(max_positions, dtype=np.float32)[:, None]
    with np.errstate(all="ignore"):  # extreme settings are refused below, not warned about
        freqs = (positions * inverse_frequencies(rope, head_dim, long)[None, :]).astype(np.float32)
        scale = np.float32(rope.attention_factor)
        cos, sin = (np.cos(freqs) * scale).astype(np.float32), (np.sin(freqs) * scale).astype(np.float32)
    if not (np.isfinite(cos).all() and np.isfinite(sin).all()):
        raise CheckpointError(f"the rope settings in config.json give rotary tables that are not finite: {rope}; "
                              "check rope_theta and the rope scaling fields")
    return cos, sin
