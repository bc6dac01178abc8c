"""A model's rotary embedding, normalised from its config.json (hf_rope.py reads it): the one description the
builder's tables and the runtime's LongRoPE choice share."""

from __future__ import annotations

from dataclasses import dataclass

from camshaft.checks import is_int_at_least
from camshaft.errors import CheckpointError, UnsupportedModelError
from camshaft.hf_rope import ATTENTION_FACTORS, ROPE_TYPES


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # yarn, longrope: cos/sin scaled by it (transformers' attention_scaling)
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to original_max_position_embeddings
    long_factor: tuple[float, ...] = ()  # longrope: the same beyond it
    partial_rotary_factor: float = 1.0  # the share of each head rotated (its first dimensions; Phi-4-mini: 0.75)

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {self.type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        low, high = ATTENTION_FACTORS
        if not (self.theta > 0 and self.factor > 0 and low < self.attention_factor < high
                and is_int_at_least(self.original_max_position_embeddings, 1)):
            raise CheckpointError(f"rope theta, factor, attention_factor and original_max_position_embeddings must be "
                                  f"positive: {self}")
        if not (positive_number(self.partial_rotary_factor) and self.partial_rotary_factor <= 1):
            raise CheckpointError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        object.__setattr__(self, "short_factor", tuple(self.short_factor))
        object.__setattr__(self, "long_factor", tuple(self.long_factor))
        factors = self.short_factor + self.long_factor
        if self.type == "longrope" and not (self.short_factor and len(self.short_factor) == len(self.long_factor)
                                            and all(positive_number(x) for x in factors)):
            raise CheckpointError("longrope needs short_factor and long_factor: lists of the same length of positive "
                                  f"numbers, got {list(self.short_factor)} and {list(self.long_factor)}")

    def long_rope_from(self, longest_pass: int) -> int:
        """The first position a sequence rotates with LongRoPE's long factors when its forward passes cover at most
        `longest_pass` tokens: every one if that is longer than the original context, else none it reaches
        (transformers rotates a forward pass so; its generate recomputes the cache of a sequence that grows past it,
        the same from there on)."""
        return 0 if longest_pass > self.original_max_position_embeddings else self.original_max_position_embeddings

    def switches_to_long(self, max_seq_len: int) -> bool:
        """Whether sequences of up to `max_seq_len` tokens reach LongRoPE's long factors."""
        return self.type == "longrope" and max_seq_len > self.original_max_position_embeddings


def positive_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and 0 < x < float("inf")
