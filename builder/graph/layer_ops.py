"""What the batch graph (decoder.py) and the sequence graph (sequence.py) lower the same way: norm weights, RMSNorm,
per-head q/k norm and rotary embedding. A lowering sets `g`, `c`, `np_dtype` and `weights`, calls `rope_tables`, and
sets `positions` before it uses `rope`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from camshaft.builder.experts import read_experts
from camshaft.builder.graph.linear import MS_DOMAIN
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
        """An RMSNorm's scale: its weight, plus the model's norm_offset (Gemma's norms scale by 1 + weight)."""
        weight = self.weights(name, (dim,))  # float32
        if self.c.norm_offset:
            weight = np.float32(self.c.norm_offset) + weight
        return self.g.weight(name, weight.astype(self.np_dtype))

    def rms_norm(self, x: str, weight: str, dim: int) -> str:
        return self.g.op("RMSNormalization", [x, self.norm_weight(weight, dim)], axis=-1, epsilon=self.c.rms_norm_eps)

    def head_norm(self, x: str, weight: str, heads: int) -> str:
        """The q or k norm of [.., heads*dim]: per head (Qwen3, Gemma 3), or over all heads at once (OLMo 2),
        returned as [1, T, heads*dim] ready for rope."""
        g, d = self.g, self.c.head_dim
        if not self.c.qk_norm_per_head:
            return g.op("Reshape", [self.rms_norm(x, weight, heads * d), g.ints([1, -1, heads * d])])
        x = g.op("Reshape", [x, g.ints([1, -1, heads, d])])
        x = self.rms_norm(x, weight, d)
        return g.op("Reshape", [x, g.ints([1, -1, heads * d])])

    def rope_tables(self, limits: BuildLimits) -> None:
        """cos/sin rows for every position, and at least one per packed token: ONNX Runtime's RotaryEmbedding
        refuses a [1, T, ...] input with T above its table's rows (a step may pack more tokens than max_seq_len).
        Both graphs' tables are the same tensors, stored once. LongRoPE reaching its long factors: the long rows
        follow the short ones (`long_rope_rows` on)."""
        rows = max(limits.max_seq_len, limits.max_num_tokens)
        tables = [cos_sin_tables(self.c.rope, self.c.rotary_dim, rows)]
        self.long_rope_rows = rows if self.c.rope.switches_to_long(limits.max_seq_len) else None
        if self.long_rope_rows:
            tables.append(cos_sin_tables(self.c.rope, self.c.rotary_dim, rows, long=True))
        cos, sin = (np.concatenate(parts).astype(self.np_dtype) for parts in zip(*tables, strict=True))
        self.cos, self.sin = self.g.weight("rope_cos", cos), self.g.weight("rope_sin", sin)
        self.local_tables = None
        if self.c.local_rope is not None:  # Gemma's sliding layers
            cos, sin = cos_sin_tables(self.c.local_rope, self.c.rotary_dim, rows)
            self.local_tables = (self.g.weight("rope_cos_local", cos.astype(self.np_dtype)),
                                 self.g.weight("rope_sin_local", sin.astype(self.np_dtype)))

    def tables(self, layer: int) -> tuple[str, str]:
        """The cos/sin tables layer `layer` rotates with."""
        if self.local_tables is not None and self.c.layer_rope(layer) is self.c.local_rope:
            return self.local_tables
        return self.cos, self.sin

    def final_logits(self, logits: str) -> str:
        """The head's output as the model ends: capped at ± its logit_softcap (Gemma 2: cap * tanh(logits / cap)),
        divided by its logits_divisor (Granite's logits_scaling)."""
        g, c = self.g, self.c
        if c.logit_softcap is not None:
            limit = g.const(np.array(c.logit_softcap, self.np_dtype), "logit_softcap")
            logits = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, limit])]), limit])
        if c.logits_divisor != 1.0:
            logits = g.op("Div", [logits, g.const(np.array(c.logits_divisor, self.np_dtype), "logits_divisor")])
        return logits

    def joining(self, out: str, norm: str) -> str:
        """A sublayer's output as it joins the residual stream: normed by its `norm` (sandwich norms: Gemma, OLMo 2),
        times the model's residual_scale (Granite)."""
        if self.c.sandwich_norms:
            out = self.rms_norm(out, f"{norm}.weight", self.c.hidden_size)
        if self.c.residual_scale == 1.0:
            return out
        return self.g.op("Mul", [out, self.g.const(np.array(self.c.residual_scale, self.np_dtype), "residual_scale")])

    def experts(self, x: str, layer: int) -> str:
        """Layer `layer`'s mixture of experts on [T, hidden] (ONNX Runtime's MoE: softmax over the router's logits,
        the top experts_per_token, SwiGLU experts whose gate and up rows it takes interleaved)."""
        g, c = self.g, self.c
        router_name, router, gate_up, down = read_experts(c, layer, self.weights, self.np_dtype)
        logits = g.op("MatMul", [x, g.weight(router_name, np.ascontiguousarray(router.T, self.np_dtype))])
        p = f"model.layers.{layer}.experts"
        return g.op("MoE", [x, logits, g.weight(f"{p}.gate_up", gate_up), "", g.weight(f"{p}.down", down)],
                    domain=MS_DOMAIN, k=c.experts_per_token,
                    activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                    swiglu_limit=float(np.finfo(np.float32).max), normalize_routing_weights=int(
                        c.normalize_expert_weights))

    def activation(self, gate: str, up: str) -> str:
        """The gated MLP's act(gate) * up: SiLU, or GELU's tanh form (Gemma)."""
        g = self.g
        if self.c.activation == "gelu_tanh":
            return g.op("Mul", [g.op("Gelu", [gate], approximate="tanh"), up])
        return g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    def rope_rows(self, positions: str) -> str:
        """The table rows of `positions`: past the short rows from input `long_rope_from` on (LongRoPE)."""
        if not self.long_rope_rows:
            return positions
        g = self.g
        offset = g.op("Where", [g.op("GreaterOrEqual", [positions, "long_rope_from"]),
                                g.const(np.array(self.long_rope_rows, np.int64), "long_rope_rows"),
                                g.const(np.array(0, np.int64), "zero")])
        return g.op("Add", [positions, offset])

    def rope(self, x: str, heads: int, layer: int) -> str:
        """[1, T, heads*dim] → rotated, same shape, with layer `layer`'s tables (a NoPE layer's: as it is)."""
        if layer in self.c.layers_without_rope:
            return x
        partial = {"rotary_embedding_dim": self.c.rotary_dim} if self.c.rotary_dim < self.c.head_dim else {}
        cos, sin = self.tables(layer)
        return self.g.op("RotaryEmbedding", [x, cos, sin, self.positions], num_heads=heads, interleaved=0, **partial)


def pre_mlp_norm(c: ModelConfig, prefix: str) -> str | None:
    """The weight of the norm before a layer's MLP: Llama's post_attention_layernorm; Gemma's
    pre_feedforward_layernorm (its post_attention_layernorm norms the attention output); none in OLMo 2."""
    if not c.pre_norms:
        return None
    return f"{prefix}.{'pre_feedforward_layernorm' if c.sandwich_norms else 'post_attention_layernorm'}.weight"


def softcap(c: ModelConfig) -> dict[str, float]:
    """The attention node's softcap attribute (Gemma 2), applied to the scaled scores before the mask."""
    return {} if c.attn_softcap is None else {"softcap": float(c.attn_softcap)}
