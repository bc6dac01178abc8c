"""Lowers a decoder-only transformer (Llama, Mistral, Qwen2, Qwen3) to one ONNX graph over a packed token batch.

The graph takes T tokens from many sequences at once (decode tokens and prefill chunks mixed), writes their K/V into
a paged cache and returns logits only for the rows in `logits_index`. Per layer:
  linear layers on packed [T, hidden];
  K/V written with ScatterND at (block, offset) pairs into per-layer caches [num_blocks, block_size, kv_heads, dim],
  bound as both input and output so the runtime's buffers are updated in place;
  attention in two groups that never pay each other's padding: decode tokens ([Bd, 1] queries) and prefill chunks
  ([Bp, Qp] queries, padded), each gathering its sequences' K/V through block tables into [B, L, kv_heads*dim]
  with a boolean mask built by the runtime (causal, lengths, sliding window);
  group outputs concatenated and gathered back into packed order by `attn_output_index`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import TensorProto

from camshaft.builder.graph.ops import ONNX_DTYPES, GraphWriter
from camshaft.builder.graph.rope import cos_sin_tables
from camshaft.manifest import BuildLimits, KVCacheLayout, TensorSpec
from camshaft.model_config import ModelConfig

OPSET = 23
I64, BOOL = TensorProto.INT64, TensorProto.BOOL

# Name, dtype and symbolic shape of every non-cache input; the runtime builds exactly these.
STEP_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("input_ids", "int64", ("T",)),
    TensorSpec("positions", "int64", ("T",)),
    TensorSpec("kv_write_index", "int64", ("T", 2)),
    TensorSpec("logits_index", "int64", ("N",)),
    TensorSpec("decode_token_index", "int64", ("Bd",)),
    TensorSpec("decode_block_tables", "int64", ("Bd", "NBd")),
    TensorSpec("decode_mask", "bool", ("Bd", 1, 1, "Ld")),
    TensorSpec("prefill_token_index", "int64", ("Bp", "Qp")),
    TensorSpec("prefill_block_tables", "int64", ("Bp", "NBp")),
    TensorSpec("prefill_mask", "bool", ("Bp", 1, "Qp", "Lp")),
    TensorSpec("attn_output_index", "int64", ("T",)),
)
SLIDING_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("decode_mask_sliding", "bool", ("Bd", 1, 1, "Ld")),
    TensorSpec("prefill_mask_sliding", "bool", ("Bp", 1, "Qp", "Lp")),
)
ELEM = {"int64": I64, "bool": BOOL}

WeightFn = Callable[[str, tuple[int, ...]], np.ndarray]


def kv_layout(config: ModelConfig, limits: BuildLimits, kv_dtype: str) -> KVCacheLayout:
    n = range(config.num_layers)
    return KVCacheLayout(
        dtype=kv_dtype,
        block_size=limits.kv_block_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        key_inputs=tuple(f"kv_cache_k_{i}" for i in n),
        value_inputs=tuple(f"kv_cache_v_{i}" for i in n),
        key_outputs=tuple(f"kv_cache_k_{i}_out" for i in n),
        value_outputs=tuple(f"kv_cache_v_{i}_out" for i in n),
    )


def step_inputs(config: ModelConfig) -> tuple[TensorSpec, ...]:
    return STEP_INPUTS + (SLIDING_INPUTS if config.has_sliding_layers else ())


class DecoderLowering:
    def __init__(self, g: GraphWriter, config: ModelConfig, limits: BuildLimits, dtype: str,
                 weights: WeightFn, progress: Callable[[str], None] = lambda _: None) -> None:
        self.g, self.c, self.limits = g, config, limits
        self.np_dtype = np.float16 if dtype == "float16" else np.float32
        self.elem = ONNX_DTYPES[dtype]
        self.weights = weights
        self.progress = progress
        self.kv = kv_layout(config, limits, dtype)

    def w(self, name: str, shape: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        array = self.weights(name, shape)
        return (array.T if transpose else array).astype(self.np_dtype)

    def lower(self) -> None:
        g, c = self.g, self.c
        for spec in step_inputs(c):
            g.input(spec.name, ELEM[spec.dtype], list(spec.shape))
        cache_shape = ["num_blocks", self.kv.block_size, c.num_kv_heads, c.head_dim]
        for name in self.kv.key_inputs + self.kv.value_inputs:
            g.input(name, self.elem, cache_shape)
        cos, sin = cos_sin_tables(c.rope, c.head_dim, self.limits.max_seq_len)
        self.cos = g.weight("rope_cos", cos.astype(self.np_dtype))
        self.sin = g.weight("rope_sin", sin.astype(self.np_dtype))
        self.positions = g.op("Unsqueeze", ["positions", g.ints([0])])
        embed = g.weight("embed_tokens", self.w("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)))
        hidden = g.op("Gather", [embed, "input_ids"], axis=0)
        for layer in range(c.num_layers):
            self.progress(f"layer {layer + 1}/{c.num_layers}")
            hidden = self.layer(layer, hidden)
        picked = g.op("Gather", [hidden, "logits_index"], axis=0)
        normed = self.rms_norm(picked, "model.norm.weight", c.hidden_size)
        if c.tie_word_embeddings:
            logits = g.op("Gemm", [normed, embed], transB=1)
        else:
            head = g.weight("lm_head", self.w("lm_head.weight", (c.vocab_size, c.hidden_size), transpose=True))
            logits = g.op("MatMul", [normed, head])
        if self.elem != TensorProto.FLOAT:
            logits = g.op("Cast", [logits], to=TensorProto.FLOAT)
        g.op_to("Identity", [logits], "logits")
        g.output("logits", TensorProto.FLOAT, ["N", c.vocab_size])
        for name in self.kv.key_outputs + self.kv.value_outputs:
            g.output(name, self.elem, cache_shape)

    def rms_norm(self, x: str, weight: str, dim: int) -> str:
        scale = self.g.weight(weight, self.w(weight, (dim,)))
        return self.g.op("RMSNormalization", [x, scale], axis=-1, epsilon=self.c.rms_norm_eps)

    def linear(self, x: str, prefix: str, out_dim: int, in_dim: int, bias: bool) -> str:
        weight = self.g.weight(f"{prefix}.weight", self.w(f"{prefix}.weight", (out_dim, in_dim), transpose=True))
        y = self.g.op("MatMul", [x, weight])
        if bias:
            y = self.g.op("Add", [y, self.g.weight(f"{prefix}.bias", self.w(f"{prefix}.bias", (out_dim,)))])
        return y

    def fused_linear(self, x: str, prefixes: list[str], out_dims: list[int], in_dim: int, bias: bool,
                     name: str) -> list[str]:
        weight = np.concatenate([self.w(f"{p}.weight", (o, in_dim), transpose=True)
                                 for p, o in zip(prefixes, out_dims, strict=True)], axis=1)
        y = self.g.op("MatMul", [x, self.g.weight(f"{name}.weight", weight)])
        if bias:
            b = np.concatenate([self.w(f"{p}.bias", (o,)) for p, o in zip(prefixes, out_dims, strict=True)])
            y = self.g.op("Add", [y, self.g.weight(f"{name}.bias", b)])
        return self.g.op("Split", [y, self.g.ints(out_dims)], n_out=len(out_dims), axis=-1)

    def rope(self, x: str, heads: int) -> str:
        g = self.g
        x3 = g.op("Unsqueeze", [x, g.ints([0])])
        y = g.op("RotaryEmbedding", [x3, self.cos, self.sin, self.positions], num_heads=heads, interleaved=0)
        return g.op("Squeeze", [y, g.ints([0])])

    def head_norm(self, x: str, weight: str, heads: int) -> str:
        g, d = self.g, self.c.head_dim
        x = g.op("Reshape", [x, g.ints([0, heads, d])])
        x = self.rms_norm(x, weight, d)
        return g.op("Reshape", [x, g.ints([0, heads * d])])

    def layer(self, i: int, hidden: str) -> str:
        g, c = self.g, self.c
        p = f"model.layers.{i}"
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        x = self.rms_norm(hidden, f"{p}.input_layernorm.weight", c.hidden_size)
        q, k, v = self.fused_linear(
            x, [f"{p}.self_attn.{n}_proj" for n in "qkv"], [hq * d, hkv * d, hkv * d], c.hidden_size,
            c.qkv_bias, f"{p}.self_attn.qkv_proj")
        if c.qk_norm:
            q = self.head_norm(q, f"{p}.self_attn.q_norm.weight", hq)
            k = self.head_norm(k, f"{p}.self_attn.k_norm.weight", hkv)
        q, k = self.rope(q, hq), self.rope(k, hkv)
        k_cache = g.op_to("ScatterND", [self.kv.key_inputs[i], "kv_write_index",
                                        g.op("Reshape", [k, g.ints([0, hkv, d])])], self.kv.key_outputs[i])
        v_cache = g.op_to("ScatterND", [self.kv.value_inputs[i], "kv_write_index",
                                        g.op("Reshape", [v, g.ints([0, hkv, d])])], self.kv.value_outputs[i])
        suffix = "_sliding" if c.layer_types[i] == "sliding" else ""
        decode = self.attention(q, k_cache, v_cache, "decode_token_index", "decode_block_tables",
                                f"decode_mask{suffix}", unsqueeze_query=True)
        prefill = self.attention(q, k_cache, v_cache, "prefill_token_index", "prefill_block_tables",
                                 f"prefill_mask{suffix}", unsqueeze_query=False)
        attn = g.op("Concat", [decode, prefill], axis=0)
        attn = g.op("Gather", [attn, "attn_output_index"], axis=0)
        hidden = g.op("Add", [hidden, self.linear(attn, f"{p}.self_attn.o_proj", c.hidden_size, hq * d, c.o_bias)])
        x = self.rms_norm(hidden, f"{p}.post_attention_layernorm.weight", c.hidden_size)
        gate, up = self.fused_linear(x, [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"],
                                     [c.intermediate_size] * 2, c.hidden_size, c.mlp_bias, f"{p}.mlp.gate_up_proj")
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        down = self.linear(act, f"{p}.mlp.down_proj", c.hidden_size, c.intermediate_size, c.mlp_bias)
        return g.op("Add", [hidden, down])

    def attention(self, q: str, k_cache: str, v_cache: str, token_index: str, block_tables: str, mask: str,
                  unsqueeze_query: bool) -> str:
        g, c = self.g, self.c
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        query = g.op("Gather", [q, token_index], axis=0)
        if unsqueeze_query:
            query = g.op("Unsqueeze", [query, g.ints([1])])
        kv_shape = g.ints([0, -1, hkv * d])
        keys = g.op("Reshape", [g.op("Gather", [k_cache, block_tables], axis=0), kv_shape])
        values = g.op("Reshape", [g.op("Gather", [v_cache, block_tables], axis=0), kv_shape])
        out = g.op("Attention", [query, keys, values, mask], q_num_heads=hq, kv_num_heads=hkv,
                   scale=float(d) ** -0.5)
        return g.op("Reshape", [out, g.ints([-1, hq * d])])
