"""Lowers a decoder-only transformer (Llama, Mistral, Qwen2, Qwen3) to one ONNX graph over a packed token batch.

The graph takes T tokens from many sequences at once (decode tokens and prefill chunks mixed), writes their K/V into
a paged cache and returns logits only for the rows in `logits_index`. Per layer:
  linear layers on packed [T, hidden] (float or quantized: linear.py);
  K/V written with ScatterND at (block, offset) pairs into per-layer caches [num_blocks, block_size, kv_heads*dim],
  bound as both input and output so the runtime's buffers are updated in place (an int8/float8 cache quantizes on
  write and dequantizes after the Gather: kv_quant.py);
  attention in two groups that never pay each other's padding: decode tokens ([Bd, 1] queries) and prefill chunks
  ([Bp, Qp] queries, padded), each gathering its sequences' K/V through block tables into [B, L, kv_heads*dim]
  with a boolean mask built by the runtime (causal, lengths, sliding window);
  group outputs concatenated and gathered back into packed order by `attn_output_index`.
With `branches` (the onnxruntime target) each group's attention sits in an If on `has_decode` / `has_prefill`, so a
step skips a group it has no sequences for; without, an empty group runs on the runtime's one-token dummy. With
`grouped_decode` (the onnxruntime target) decode attention treats the query heads sharing a K/V head as query rows
of that head: one product per K/V head instead of one per query head (about half the attention kernel time in the
batch-32 decode profile).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import TensorProto

from camshaft.builder.graph.head import Head
from camshaft.builder.graph.kv_quant import KV_ELEM, KVQuantizer
from camshaft.builder.graph.layer_ops import LayerOps, pre_mlp_norm, softcap
from camshaft.builder.graph.linear import Linears, QuantizedFn, WeightFn
from camshaft.builder.graph.ops import NP_DTYPES, ONNX_DTYPES, GraphWriter
from camshaft.io_signature import (
    GROUP_FLAGS,
    LONG_ROPE_INPUTS,
    SLIDING_INPUTS,
    STEP_INPUTS,
    KVCacheLayout,
    TensorSpec,
)
from camshaft.manifest import BuildLimits
from camshaft.model_config import ModelConfig

OPSET = 23
I64, BOOL = TensorProto.INT64, TensorProto.BOOL

ELEM = {"int64": I64, "int32": TensorProto.INT32, "bool": BOOL}  # manifest dtypes of graph inputs

KVScalesFn = Callable[[int], tuple[float, float]]
KVBiasesFn = Callable[[int], tuple[np.ndarray | None, np.ndarray | None]]


def kv_layout(config: ModelConfig, limits: BuildLimits, kv_dtype: str) -> KVCacheLayout:
    names = KVCacheLayout.names(config.num_layers, "kv_cache_k_{}", "kv_cache_v_{}", "kv_cache_k_{}_out",
                                "kv_cache_v_{}_out")
    return KVCacheLayout(config.num_kv_heads, config.head_dim, **names, dtype=kv_dtype,
                         block_size=limits.kv_block_size)


def step_inputs(config: ModelConfig, limits: BuildLimits, branches: bool = False) -> tuple[TensorSpec, ...]:
    return (STEP_INPUTS + (GROUP_FLAGS if branches else ()) + (SLIDING_INPUTS if config.has_sliding_layers else ())
            + (LONG_ROPE_INPUTS if config.rope.switches_to_long(limits.max_seq_len) else ()))


class DecoderLowering(LayerOps):
    def __init__(self, g: GraphWriter, config: ModelConfig, limits: BuildLimits, dtype: str,
                 weights: WeightFn, progress: Callable[[str], None] = lambda _: None,
                 quantized: QuantizedFn | None = None, accuracy_level: int | None = None,
                 kv_cache: tuple[str, KVScalesFn, KVBiasesFn] | None = None, qdq: bool = False,
                 lm_head: str = "float", lm_head_float_channels: tuple[int, ...] = (), branches: bool = False,
                 grouped_decode: bool = False) -> None:
        self.g, self.c, self.limits = g, config, limits
        self.branches, self.grouped_decode = branches, grouped_decode
        self.np_dtype = NP_DTYPES[dtype]
        self.elem = ONNX_DTYPES[dtype]
        self.weights = weights
        self.progress = progress
        self.linears = Linears(g, self.np_dtype, weights, quantized, accuracy_level, qdq)
        self.head = Head(self.linears, config, lm_head, lm_head_float_channels)
        # A quantized KV cache: (int8 | float8, layer → (k_scale, v_scale)); else the cache holds the float type.
        self.kv_quant = KVQuantizer(g, kv_cache[0], self.np_dtype) if kv_cache else None
        self.kv_scales = kv_cache[1] if kv_cache else None
        self.kv_biases = kv_cache[2] if kv_cache else None
        self.kv = kv_layout(config, limits, kv_cache[0] if kv_cache else dtype)
        self.kv_elem = KV_ELEM[kv_cache[0]] if kv_cache else self.elem

    def lower(self) -> None:
        g, c = self.g, self.c
        for spec in step_inputs(c, self.limits, self.branches):
            g.input(spec.name, ELEM[spec.dtype], list(spec.shape))
        cache_shape = ["num_blocks", self.kv.block_size, c.num_kv_heads * c.head_dim]
        for name in self.kv.key_inputs + self.kv.value_inputs:
            g.input(name, self.kv_elem, cache_shape)
        self.rope_tables(self.limits)
        # Linear layers run on 2D [T, hidden] (so ORT fuses the residual adds into Gemm); q and k move to
        # [1, T, hidden] for RotaryEmbedding and stay there, so the batch dim is added to the indices once, here.
        one = g.ints([0])
        self.positions = g.op("Unsqueeze", [self.rope_rows("positions"), one])
        self.write_index = g.op("Unsqueeze", ["kv_write_index", one])
        self.groups = {name: self.group_shapes(name) for name in ("decode", "prefill")}
        if self.branches:
            self.zero_row = g.const(np.zeros((1, c.num_heads * c.head_dim), self.np_dtype), "zero_row")
        hidden = self.head.embed("input_ids")
        for layer in range(c.num_layers):
            self.progress(f"layer {layer + 1}/{c.num_layers}")
            hidden = self.layer(layer, hidden)
        picked = g.op("Gather", [hidden, "logits_index"], axis=0)
        normed = self.rms_norm(picked, "model.norm.weight", c.hidden_size)
        logits = self.final_logits(self.head.lower(normed))
        if self.elem != TensorProto.FLOAT:
            logits = g.op("Cast", [logits], to=TensorProto.FLOAT)
        g.op_to("Identity", [logits], "logits")
        g.output("logits", TensorProto.FLOAT, ["N", c.vocab_size])
        for name in self.kv.key_outputs + self.kv.value_outputs:
            g.output(name, self.kv_elem, cache_shape)

    def layer(self, i: int, hidden: str) -> str:
        g, c = self.g, self.c
        p = f"model.layers.{i}"
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        x = self.rms_norm(hidden, f"{p}.input_layernorm.weight", c.hidden_size) if c.pre_norms else hidden
        q, k, v = self.linears.fused(
            x, [f"{p}.self_attn.{n}_proj" for n in "qkv"], [hq * d, hkv * d, hkv * d], c.hidden_size,
            c.qkv_bias, f"{p}.self_attn.qkv_proj")
        if c.qk_norm:
            q = self.head_norm(q, f"{p}.self_attn.q_norm.weight", hq)
            k = self.head_norm(k, f"{p}.self_attn.k_norm.weight", hkv)
        else:
            q, k = (g.op("Unsqueeze", [t, g.ints([0])]) for t in (q, k))
        q, k = self.rope(q, hq, i), self.rope(k, hkv, i)
        scales = self.kv_scales(i) if self.kv_scales else None
        biases = self.kv_biases(i) if self.kv_biases else (None, None)
        if self.kv_quant is not None:
            k, v = self.kv_quant.write(k, scales[0], biases[0]), self.kv_quant.write(v, scales[1], biases[1])
        k_cache = g.op_to("ScatterND", [self.kv.key_inputs[i], self.write_index, k], self.kv.key_outputs[i])
        v_cache = g.op_to("ScatterND", [self.kv.value_inputs[i], "kv_write_index", v], self.kv.value_outputs[i])
        suffix = "_sliding" if c.layer_types[i] == "sliding" else ""
        caches = (k_cache, v_cache, scales, biases, f"{p}.self_attn")
        decode, prefill = (self.group_attention(q, caches, name, suffix) for name in ("decode", "prefill"))
        attn = g.op("Concat", [decode, prefill], axis=0)
        attn = g.op("Gather", [attn, "attn_output_index"], axis=0)
        o = self.linears.linear(attn, f"{p}.self_attn.o_proj", c.hidden_size, hq * d, c.o_bias)
        hidden = g.op("Add", [hidden, self.joining(o, f"{p}.post_attention_layernorm")])
        norm = pre_mlp_norm(c, p)
        x = self.rms_norm(hidden, norm, c.hidden_size) if norm else hidden
        if i in c.moe_layers:
            down = self.experts(x, i)
        else:  # gate and up as two products: one fused product + Split measured ~5 % slower decode on the CPU target
            gate, up = (self.linears.linear(x, f"{p}.mlp.{n}_proj", c.intermediate_size, c.hidden_size, c.mlp_bias)
                        for n in ("gate", "up"))
            down = self.linears.linear(self.activation(gate, up), f"{p}.mlp.down_proj", c.hidden_size,
                                       c.intermediate_size, c.mlp_bias)
        return g.op("Add", [hidden, self.joining(down, f"{p}.post_feedforward_layernorm")])

    def group_shapes(self, name: str) -> dict[str, str]:
        """Shapes of one attention group, computed once and shared by every layer (explicit, no -1)."""
        g, c = self.g, self.c
        index, mask = f"{name}_token_index", f"{name}_mask"
        batch = g.op("Shape", [index], start=0, end=1)
        keys = g.op("Shape", [mask], start=3, end=4)
        if name == "decode":
            q_len = g.ints([1])
            rows = batch
        else:
            q_len = g.op("Shape", [index], start=1, end=2)
            rows = g.op("Mul", [batch, q_len])
        shapes = {
            "index": index,
            "tables": f"{name}_block_tables",
            "query": g.op("Concat", [batch, q_len, g.ints([c.num_heads * c.head_dim])], axis=0),
            "kv": g.op("Concat", [batch, keys, g.ints([c.num_kv_heads * c.head_dim])], axis=0),
            "out": g.op("Concat", [rows, g.ints([c.num_heads * c.head_dim])], axis=0),
        }
        if name == "decode" and self.grouped_decode and c.num_heads > c.num_kv_heads:
            shapes.update(self.grouped_decode_shapes(batch, keys, mask))
        return shapes

    def grouped_decode_shapes(self, batch: str, keys: str, mask: str) -> dict[str, str]:
        """Decode queries regrouped per K/V head: the `per_kv` query heads that share a K/V head become `per_kv`
        query rows of one head, so attention multiplies each sequence's keys once per K/V head (one [per_kv, D] x
        [D, L] product) instead of once per query head. The mask is repeated over those rows."""
        g, c = self.g, self.c
        per_kv, kv, d = c.num_heads // c.num_kv_heads, c.num_kv_heads, c.head_dim
        mask_shape = g.op("Concat", [batch, g.ints([1, per_kv]), keys], axis=0)
        suffixes = ("", "_sliding") if c.has_sliding_layers else ("",)
        return {
            "by_kv_head": g.op("Concat", [batch, g.ints([kv, per_kv, d])], axis=0),
            "grouped_query": g.op("Concat", [batch, g.ints([per_kv, kv * d])], axis=0),
            "grouped_out": g.op("Concat", [batch, g.ints([per_kv, kv, d])], axis=0),
            **{f"mask{s}": g.op("Expand", [f"{mask}{s}", mask_shape]) for s in suffixes},
        }

    def group_attention(self, q: str, caches: tuple, name: str, mask_suffix: str) -> str:
        """A group's attention rows; with branches, an empty group (`has_<name>` false) yields one zero row instead,
        the row its dummy would have taken, so the other group's rows stay where `attn_output_index` expects them."""
        group = self.groups[name]
        mask = group.get(f"mask{mask_suffix}", f"{name}_mask{mask_suffix}")
        if not self.branches:
            return self.attention(q, caches, group, mask)
        return self.g.branch(f"has_{name}", lambda: self.attention(q, caches, group, mask), self.zero_row, self.elem)

    def attention(self, q: str, caches: tuple, group: dict[str, str], mask: str) -> str:
        g, c = self.g, self.c
        k_cache, v_cache, scales, biases, name = caches
        query = g.op("Gather", [q, group["index"]], axis=1)
        grouped = "grouped_query" in group
        if grouped:
            query = g.op("Transpose", [g.op("Reshape", [query, group["by_kv_head"]], allowzero=1)], perm=[0, 2, 1, 3])
            query = g.op("Reshape", [query, group["grouped_query"]], allowzero=1)
        else:
            query = g.op("Reshape", [query, group["query"]], allowzero=1)
        keys, values = (g.op("Gather", [cache, group["tables"]], axis=0) for cache in (k_cache, v_cache))
        if self.kv_quant is not None:
            keys = self.kv_quant.read(keys, scales[0], f"{name}.k", biases[0])
            values = self.kv_quant.read(values, scales[1], f"{name}.v", biases[1])
        keys, values = (g.op("Reshape", [t, group["kv"]], allowzero=1) for t in (keys, values))
        out = g.op("Attention", [query, keys, values, mask], q_num_heads=c.num_kv_heads if grouped else c.num_heads,
                   kv_num_heads=c.num_kv_heads, scale=c.query_scale, **softcap(c))
        if grouped:
            out = g.op("Transpose", [g.op("Reshape", [out, group["grouped_out"]], allowzero=1)], perm=[0, 2, 1, 3])
        return g.op("Reshape", [out, group["out"]], allowzero=1)

