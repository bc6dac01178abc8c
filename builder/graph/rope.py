"""Rotary position tables, computed as transformers computes them (float32, non-interleaved halves)."""

from __future__ import annotations

import math

import numpy as np

from camshaft.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
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
    return inv_freq


def cos_sin_tables(rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """[max_positions, head_dim / 2] cosine and sine tables."""
    positions = np.arange(max_positions, dtype=np.float32)[:, None]
    freqs = (positions * inverse_frequencies(rope, head_dim)[None, :]).astype(np.float32)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
