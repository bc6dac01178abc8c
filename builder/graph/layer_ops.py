"""What the batch graph (decoder.py) and the sequence graph (sequence.py) lower the same way: norm weights, RMSNorm,
per-head q/k norm and rotary embedding. A lowering sets `g`, `c`, `np_dtype` and `weights`, calls `rope_tables`, and
sets `positions` before it uses `rope`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from camshaft.builder.graph.ops import GraphWriter
from camshaft.builder.graph.rope import cos_sin_tables
from camshaft.manifest import BuildLimits
from camshaft.model_config import ModelConfig


class LayerOps:
    g: GraphWriter
    c: ModelConfig
    np_dtype: np.dtype
    weights: Callable[[str, tuple[int, ...]], np.ndarray]
    cos: str
    sin: str
    positions: str

    def norm_weight(self, name: str, dim: int) -> str:
        return self.g.weight(name, self.weights(name, (dim,)).astype(self.np_dtype))

    def rms_norm(self, x: str, weight: str, dim: int) -> str:
        return self.g.op("RMSNormalization", [x, self.norm_weight(weight, dim)], axis=-1, epsilon=self.c.rms_norm_eps)

    def head_norm(self, x: str, weight: str, heads: int) -> str:
        """Per-head RMSNorm of [.., heads*dim], returned as [1, T, heads*dim] ready for rope."""
        g, d = self.g, self.c.head_dim
        x = g.op("Reshape", [x, g.ints([1, -1, heads, d])])
        x = self.rms_norm(x, weight, d)
        return g.op("Reshape", [x, g.ints([1, -1, heads * d])])

    def rope_tables(self, limits: BuildLimits) -> None:
        """cos/sin rows for every position, and at least one per packed token: ONNX Runtime's RotaryEmbedding
        refuses a [1, T, ...] input with T above its table's rows (a step may pack more tokens than max_seq_len).
        Both graphs' tables are the same tensors, stored once."""
        rows = max(limits.max_seq_len, limits.max_num_tokens)
        cos, sin = cos_sin_tables(self.c.rope, self.c.head_dim, rows)
        self.cos = self.g.weight("rope_cos", cos.astype(self.np_dtype))
        self.sin = self.g.weight("rope_sin", sin.astype(self.np_dtype))

    def rope(self, x: str, heads: int) -> str:
        """[1, T, heads*dim] → rotated, same shape."""
        return self.g.op("RotaryEmbedding", [x, self.cos, self.sin, self.positions], num_heads=heads, interleaved=0)
