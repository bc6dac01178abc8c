"""A quantized paged KV cache: new K/V quantized with the layer's static scale before the ScatterND write, gathered
blocks dequantized after the read. An affine cache (a static bias per KV head and channel) subtracts the bias before
quantizing and adds it back after dequantizing.

int8: QuantizeLinear, then Cast and Mul by the scale. float8 (e4m3fn): ONNX's ScatterND and Gather take no float8
tensors (and ONNX Runtime has no BitCast), so the cache holds the e4m3fn bit patterns as uint8: written as codes
computed from the QuantizeLinear-rounded value, read back through a 256-entry table of code → value x scale.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from onnx import TensorProto

from camshaft.builder.graph.ops import ONNX_DTYPES, GraphWriter

KV_ELEM = {"int8": TensorProto.INT8, "float8": TensorProto.UINT8}  # storage element type per KV cache dtype
E4M3_MIN_NORMAL = 2.0**-6


def e4m3_values() -> np.ndarray:
    """The float value of every e4m3fn bit pattern (the two NaN codes, never written, read as 0)."""
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.nan_to_num(values, nan=0.0)


class KVQuantizer:
    def __init__(self, g: GraphWriter, dtype: str, np_dtype: type) -> None:
        self.g, self.dtype, self.np_dtype = g, dtype, np_dtype
        self.elem = KV_ELEM[dtype]
        self.tables: dict[str, str] = {}  # one code → value table per cache, shared by the attention groups
        self.biases: dict[bytes, str] = {}  # one constant per bias, shared by the write and both reads

    def write(self, x: str, scale: float, bias: np.ndarray | None = None) -> str:
        """float K or V → what the cache stores."""
        g = self.g
        if bias is not None:
            x = g.op("Sub", [x, self.bias(bias)])
        s = g.const(np.array(scale, dtype=self.np_dtype), "kv_scale")
        if self.dtype == "int8":  # saturating to [-128, 127], as ModelOpt's KV quantizer does (not narrow range)
            return g.op("QuantizeLinear", [x, s, g.const(np.zeros((), np.int8), "zero_point")])
        zero = g.const(np.zeros((), ml_dtypes.float8_e4m3fn), "zero_point")
        one = g.const(np.array(1.0, dtype=self.np_dtype), "one")
        value = g.op("DequantizeLinear", [g.op("QuantizeLinear", [x, s, zero]), one, zero])  # saturated, RNE
        return g.op("Cast", [self.e4m3_code(value)], to=TensorProto.UINT8)

    def e4m3_code(self, value: str) -> str:
        """The bit pattern (as a float) of an exactly representable e4m3fn value v: sign·128 + magnitude code, where
        |v| = 2^e·(1 + m/8) (normal: code 8(e+7) + m) or m·2^-9 (subnormal: code m)."""
        g, c = self.g, self.scalar
        a = g.op("Abs", [value])
        negative = g.op("Cast", [g.op("Less", [value, c(0.0)])], to=ONNX_DTYPES[np.dtype(self.np_dtype).name])
        sign = g.op("Mul", [negative, c(128.0)])
        log2 = g.op("Mul", [g.op("Log", [g.op("Max", [a, c(E4M3_MIN_NORMAL)])]), c(1 / math.log(2))])
        e = g.op("Floor", [g.op("Add", [log2, c(0.0625)])])  # log2|v| - e lies in [0, 0.91]: a safe margin
        mantissa = g.op("Div", [g.op("Mul", [a, c(8.0)]), g.op("Pow", [c(2.0), e])])  # 8 + m, exact
        normal = g.op("Add", [g.op("Mul", [e, c(8.0)]), g.op("Add", [mantissa, c(48.0)])])
        subnormal = g.op("Mul", [a, c(512.0)])
        magnitude = g.op("Where", [g.op("Less", [a, c(E4M3_MIN_NORMAL)]), subnormal, normal])
        return g.op("Add", [magnitude, sign])

    def scalar(self, value: float) -> str:
        return self.g.const(np.array(value, dtype=self.np_dtype), "c")

    def read(self, stored: str, scale: float, name: str, bias: np.ndarray | None = None) -> str:
        """Gathered cache blocks → float K or V."""
        g = self.g
        s = g.const(np.array(scale, dtype=self.np_dtype), "kv_scale")
        if self.dtype == "int8":  # = DequantizeLinear; a DQ here meets ONNX Runtime's QDQ rewrites and breaks them
            value = g.op("Mul", [g.op("Cast", [stored], to=ONNX_DTYPES[np.dtype(self.np_dtype).name]), s])
        else:
            if name not in self.tables:
                values = (e4m3_values() * np.float32(scale)).astype(self.np_dtype)
                self.tables[name] = g.weight(f"{name}.e4m3_table", values)
            value = g.op("Gather", [self.tables[name], g.op("Cast", [stored], to=TensorProto.INT32)], axis=0)
        if bias is None:
            return value
        return g.op("Add", [value, self.bias(bias)])

    def bias(self, bias: np.ndarray) -> str:
        key = bias.astype(np.float32).tobytes()
        if key not in self.biases:
            self.biases[key] = self.g.const(bias.astype(self.np_dtype), "kv_bias")
        return self.biases[key]
