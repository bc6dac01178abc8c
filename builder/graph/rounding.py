"""Activations and weights rounded in the graph as ModelOpt's quantizers round them: int8 and float8 per token
(scales found at run time), float8 with a static scale (QuantizeLinear→DequantizeLinear)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto

from camshaft.builder.graph.ops import ONNX_DTYPES, GraphWriter


def int8_per_token(g: GraphWriter, x: str, dt: np.dtype | type) -> tuple[str, str]:
    """x's rows as ModelOpt's dynamic per-token int8 quantizer rounds them, round(x * 127 / row amax), offset by
    128 into uint8 (MatMulInteger's fast kernel); and the rows' scales amax / 127 in float32 ([T, 1]). An all-zero
    row rounds to zeros whatever its scale (ModelOpt's 1, here 127 / 2^-24)."""
    amax = g.op("ReduceMax", [g.op("Abs", [x]), g.ints([-1])], keepdims=1)
    constants = ((2.0 ** -24, "int8_amax_floor"), (127.0, "int8_max"), (128.0, "uint8_offset"))
    tiny, bound, offset = (g.const(np.array(v, dtype=dt), n) for v, n in constants)
    amax = g.op("Max", [amax, tiny])
    rounded = g.op("Round", [g.op("Mul", [x, g.op("Div", [bound, amax])])])
    xq = g.op("Cast", [g.op("Add", [rounded, offset])], to=TensorProto.UINT8)
    if dt != np.float32:
        amax = g.op("Cast", [amax], to=TensorProto.FLOAT)
    return xq, g.op("Div", [amax, g.const(np.array(127.0, dtype=np.float32), "int8_max_f32")])


def fp8_round_per_token(g: GraphWriter, x: str, dt: np.dtype | type) -> str:
    """Each row (token) of x rounded to float8 e4m3fn with scale 448 / its largest magnitude, as ModelOpt's dynamic
    per-token quantizer does (an all-zero row: scale 1)."""
    amax = g.op("ReduceMax", [g.op("Abs", [x]), g.ints([-1])], keepdims=1)
    constants = ((2.0 ** -24, "fp8_amax_floor"), (1.0, "one"), (448.0, "fp8_max"), (-448.0, "fp8_min"))
    tiny, one, bound, low = (g.const(np.array(v, dtype=dt), n) for v, n in constants)
    amax = g.op("Where", [g.op("Greater", [amax, tiny]), amax, one])
    scale = g.op("Div", [bound, amax])
    scaled = g.op("Clip", [g.op("Mul", [x, scale]), low, bound])
    rounded = g.op("Cast", [g.op("Cast", [scaled], to=TensorProto.FLOAT8E4M3FN)], to=ONNX_DTYPES[np.dtype(dt).name])
    return g.op("Mul", [rounded, g.op("Reciprocal", [scale])])


def fp8_round(g: GraphWriter, x: str, scale: np.ndarray, hint: str, dt: np.dtype | type) -> str:
    """QuantizeLinear→DequantizeLinear to float8 e4m3fn, per tensor (scalar scale) or per column ([N] scale)."""
    if scale.ndim and np.all(scale == scale[0]):
        scale = scale[:1].reshape(())
    zero = ml_dtypes.float8_e4m3fn
    if scale.ndim:
        s, z = g.weight(f"{hint}.fp8_scale", scale), g.weight(f"{hint}.fp8_zero", np.zeros(len(scale), zero))
    else:
        s, z = g.const(scale.astype(dt), hint), g.const(np.zeros((), zero), "zero_point")
    return g.op("DequantizeLinear", [g.op("QuantizeLinear", [x, s, z], axis=-1), s, z], axis=-1)
