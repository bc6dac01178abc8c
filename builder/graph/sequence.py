"""The sequence graph: one sequence at a time, for the lowest batch-1 latency (the onnxruntime target's Session).

The batch graph (decoder.py) serves many sequences through a paged cache and pays for it in every layer: gathers
through block tables, masks, two attention groups, packed-order indices. A single sequence needs none of that. This
graph keeps each layer's K/V contiguous, [1, kv_heads, L, head_dim], bound as both input and output so ONNX
Runtime's GroupQueryAttention appends in place, and lowers a layer to about a dozen nodes:
  SkipSimplifiedLayerNormalization (the residual Add fused into the norm);
  q/k/v as one product feeding GroupQueryAttention packed, rotary inside it (outside it where the head size is
  not a multiple of 16, which its rotary requires); gate/up as one product;
  the same linear layers as the batch graph (float or quantized: linear.py) on [1, S, hidden].
It returns the logits of the last `num_logits` tokens only (1 but when drafted tokens are checked: prompt lookup).
Inputs: `input_ids` [1, S]; `seqlens_k` [1] = tokens in the cache after this step - 1; `total_sequence_length`
(scalar) = tokens after this step; `num_logits` [1]. S > 1 with a non-empty cache is a later prefill chunk (or a
token and its drafts), which GroupQueryAttention accepts for batch 1.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import TensorProto

from camshaft.builder.graph.decoder import ELEM
from camshaft.builder.graph.head import Head
from camshaft.builder.graph.layer_ops import LayerOps, pre_mlp_norm, softcap
from camshaft.builder.graph.linear import MS_DOMAIN, Linears
from camshaft.builder.graph.ops import GraphWriter
from camshaft.builder.graph.screen import screened_logits, screened_rows
from camshaft.io_signature import SEQUENCE_INPUTS, SequenceGraph
from camshaft.manifest import BuildLimits
from camshaft.model_config import ModelConfig


def sequence_layout(config: ModelConfig, limits: BuildLimits, artifact: str, lm_head: str = "float") -> SequenceGraph:
    names = SequenceGraph.names(config.num_layers, "past_key_{}", "past_value_{}", "present_key_{}",
                                "present_value_{}")
    # screen.py: a float head's greedy steps (its rows outside the best are -inf, which a softcap would not keep)
    screens = lm_head == "float" and screened_rows(config.vocab_size) > 0 and config.logit_softcap is None
    unused = {"greedy"} if not screens else set()
    if not config.rope.switches_to_long(limits.max_seq_len):
        unused.add("long_rope_from")
    inputs = tuple(s for s in SEQUENCE_INPUTS if s.name not in unused)
    return SequenceGraph(config.num_kv_heads, config.head_dim, **names, artifact=artifact, inputs=inputs)


class SequenceLowering(LayerOps):
    def __init__(self, g: GraphWriter, config: ModelConfig, limits: BuildLimits, linears: Linears, head: Head,
                 weights: Callable[[str, tuple[int, ...]], np.ndarray], layout: SequenceGraph,
                 progress: Callable[[str], None] = lambda _: None) -> None:
        self.g, self.c, self.limits = g, config, limits
        self.linears, self.head, self.weights, self.layout, self.progress = linears, head, weights, layout, progress
        self.np_dtype = linears.np_dtype
        # GroupQueryAttention's rotary takes rotary halves of a multiple of 8 and reads its tables by position:
        # LongRoPE's long rows need the rotary outside
        self.fused_rope = config.rotary_dim % 16 == 0 and not config.rope.switches_to_long(limits.max_seq_len)

    def skip_norm(self, x: str, residual: str, weight: str | None) -> tuple[str, str]:
        """(RMSNorm(x + residual), x + residual) in one node; without a norm `weight` (OLMo 2): the sum twice."""
        if weight is None:
            total = self.g.op("Add", [x, residual])
            return total, total
        scale = self.norm_weight(weight, self.c.hidden_size)
        out = self.g.op("SkipSimplifiedLayerNormalization", [x, residual, scale], n_out=4, domain=MS_DOMAIN,
                        omit=(1, 2), epsilon=self.c.rms_norm_eps)  # no mean / inverse std-dev outputs
        return out[0], out[3]

    def lower(self) -> None:
        g, c, kv = self.g, self.c, self.layout
        for spec in kv.inputs:
            g.input(spec.name, ELEM[spec.dtype], list(spec.shape))
        cache_shape = [1, c.num_kv_heads, "L", c.head_dim]
        for name in kv.key_inputs + kv.value_inputs:
            g.input(name, TensorProto.FLOAT, cache_shape)
        self.rope_tables(self.limits)
        if not self.fused_rope:
            total = g.op("Cast", ["total_sequence_length"], to=TensorProto.INT64)
            start = g.op("Sub", [total, g.op("Shape", ["input_ids"], start=1, end=2)])
            positions = g.op("Range", [g.op("Squeeze", [start]), total, g.const(np.array(1, np.int64), "one")])
            self.positions = g.op("Unsqueeze", [self.rope_rows(positions), g.ints([0])])
        residual = self.head.embed("input_ids")  # [1, S, hidden]
        x = residual
        if c.pre_norms:
            scale = self.norm_weight("model.layers.0.input_layernorm.weight", c.hidden_size)
            x = g.op("SimplifiedLayerNormalization", [residual, scale], axis=-1, epsilon=c.rms_norm_eps)
        for i in range(c.num_layers):
            self.progress(f"sequence graph: layer {i + 1}/{c.num_layers}")
            p = f"model.layers.{i}"
            attn = self.attention(i, x)
            o = self.linears.linear(attn, f"{p}.self_attn.o_proj", c.hidden_size, c.num_heads * c.head_dim, c.o_bias)
            x, residual = self.skip_norm(self.joining(o, f"{p}.post_attention_layernorm"), residual,
                                         pre_mlp_norm(c, p))
            if i in c.moe_layers:  # [1, S, hidden] as the [S, hidden] rows the MoE node takes
                rows = self.experts(g.op("Reshape", [x, g.ints([-1, c.hidden_size])]), i)
                down = g.op("Reshape", [rows, g.ints([1, -1, c.hidden_size])])
            else:
                gate, up = self.gate_up(x, f"{p}.mlp")
                down = self.linears.linear(self.activation(gate, up), f"{p}.mlp.down_proj", c.hidden_size,
                                           c.intermediate_size, c.mlp_bias)
            following = "model.norm.weight" if i + 1 == c.num_layers else (
                f"model.layers.{i + 1}.input_layernorm.weight" if c.pre_norms else None)
            x, residual = self.skip_norm(self.joining(down, f"{p}.post_feedforward_layernorm"), residual, following)
        rows = g.op("Slice", [x, g.op("Neg", ["num_logits"]), g.ints([np.iinfo(np.int64).max]), g.ints([1])])
        last = g.op("Squeeze", [rows, g.ints([0])])  # the last num_logits tokens' hidden states: [N, hidden]
        if kv.screens_greedy:
            logits = self.final_logits(screened_logits(g, last, self.head.weight(), self.head.float_rows, "greedy",
                                                       lambda: self.head.lower(last)))  # -inf / divisor: -inf
        else:
            logits = self.final_logits(self.head.lower(last))
        g.op_to("Identity", [logits], "logits")
        g.output("logits", TensorProto.FLOAT, ["N", c.vocab_size])
        for name in kv.key_outputs + kv.value_outputs:
            g.output(name, TensorProto.FLOAT, cache_shape)

    def attention(self, i: int, x: str) -> str:
        g, c, kv = self.g, self.c, self.layout
        p = f"model.layers.{i}.self_attn"
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = self.linears.fused(x, [f"{p}.{n}_proj" for n in "qkv"], [hq * d, hkv * d, hkv * d], c.hidden_size,
                                 c.qkv_bias, f"{p}.qkv_proj", split=not self.fused_rope or c.qk_norm)
        if c.qk_norm:
            q, k, v = qkv
            qkv = [self.head_norm(q, f"{p}.q_norm.weight", hq), self.head_norm(k, f"{p}.k_norm.weight", hkv), v]
        if not self.fused_rope:
            q, k, v = qkv
            qkv = [self.rope(q, hq, i), self.rope(k, hkv, i), v]
        query, key, value = (qkv[0], "", "") if len(qkv) == 1 else qkv
        rotary = self.fused_rope and i not in c.layers_without_rope  # a NoPE layer's q and k stay as they are
        # local_window_size keys before the query, plus the query: what transformers attends for sliding_window
        window = c.sliding_window if c.layer_types[i] == "sliding" else None
        out = g.op("GroupQueryAttention", [query, key, value, kv.key_inputs[i], kv.value_inputs[i], "seqlens_k",
                                           "total_sequence_length"] + (list(self.tables(i)) if rotary else []),
                   n_out=3, domain=MS_DOMAIN, num_heads=hq, kv_num_heads=hkv, scale=c.query_scale, **softcap(c),
                   do_rotary=int(rotary), local_window_size=window or -1)
        node = g.nodes[-1]
        node.output[1], node.output[2] = kv.key_outputs[i], kv.value_outputs[i]
        return out[0]

    def gate_up(self, x: str, p: str) -> list[str]:
        """gate and up as one product (faster at batch 1 in a scratch A/B; the batch graph keeps two). Float and
        MatMulNBits weights stay the batch graph's two tensors each, joined by a Concat that ONNX Runtime folds at
        load, so the engine stores them once (builder/sequence_graph.py); other formats (and biases) keep the batch
        graph's two products, and so its tensors."""
        c, g, linears = self.c, self.g, self.linears
        names, dims = [f"{p}.{n}_proj" for n in ("gate", "up")], [c.intermediate_size] * 2
        layers = [linears.quantized(n, c.intermediate_size, c.hidden_size) for n in names]
        if not c.mlp_bias and all(q is None for q in layers):
            weights = [g.weight(f"{n}.weight", linears.float_weight(f"{n}.weight", (c.intermediate_size,
                                                                                 c.hidden_size))) for n in names]
            y = g.op("MatMul", [x, g.op("Concat", weights, axis=1)])
        elif not c.mlp_bias and linears.joinable_nbits(layers, c.hidden_size):
            y = linears.matmul_nbits(x, layers, f"{p}.gate_up_proj", c.hidden_size, joined=names)
        else:
            return [linears.linear(x, n, c.intermediate_size, c.hidden_size, c.mlp_bias) for n in names]
        return g.op("Split", [y, g.ints(dims)], n_out=2, axis=-1)
