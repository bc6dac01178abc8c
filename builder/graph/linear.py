"""Linear layers on packed [T, in] activations, float or quantized.

- weight-only INT4/INT8 → one com.microsoft MatMulNBits (ONNX Runtime CPU);
- W4A8 AWQ → the FP8 input, and the INT4 weight through blocked DequantizeLinear then float8 Q/DQ;
- FP8 → QuantizeLinear→DequantizeLinear of the input with its static per-tensor scale and DequantizeLinear of the
  stored float8 weight, then MatMul: ModelOpt's fake-quant numerics in standard ONNX;
- W8A8 (SmoothQuant) → the input quantized with its static scale to uint8 (zero point 128: the same integers as
  int8), MatMulInteger with the int8 weight (exact int32 sums; ONNX Runtime's fast u8s8 kernel, s8s8 is ~20x
  slower), then Mul by input scale x weight scale; with per-token inputs each row's scale comes from its largest
  magnitude at run time (ReduceMax), the row rounded and offset by 128 in float. (The Q/DQ form is fused by ONNX
  Runtime into an integer kernel only where no residual Add was first fused into a Gemm.)
Layers sharing an input (q/k/v) become one product when their formats, pre-quant scales and input scales
agree; otherwise each layer is lowered alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import ml_dtypes
import numpy as np
from onnx import TensorProto

from camshaft.builder.checkpoint import FP8, QuantizedLinear
from camshaft.builder.graph.ops import ONNX_DTYPES, GraphWriter
from camshaft.builder.graph.rounding import fp8_round, fp8_round_per_token, int8_per_token

MS_DOMAIN = "com.microsoft"
# MatMulNBits block sizes; accuracy_level 0 computes in the activation's float type (4 quantizes activations to int8).
NBITS_BLOCK_SIZES = (128, 64, 32, 16)
NBITS_ACCURACY_LEVEL = 0
LOWERINGS = {
    "nbits": "com.microsoft.MatMulNBits",
    "int8": "QuantizeLinear uint8 + MatMulInteger + Mul by input x weight scales",
    "int8_per_token": "input rounded to int8 per token (ReduceMax, Round) + MatMulInteger + Mul by token x weight "
                      "scales",
    "fp8": "QuantizeLinear/DequantizeLinear float8e4m3fn + MatMul",
    "fp8_per_token": "input rounded to float8e4m3fn per token (ReduceMax, Cast) + weight DequantizeLinear + MatMul",
    "w4a8": "float8 input Q/DQ; int4 blocked DequantizeLinear, float8 Q/DQ of the weight; MatMul",
    "qdq": "standard Q/DQ: input QuantizeLinear/DequantizeLinear per format, weight DequantizeLinear; MatMul",
}

WeightFn = Callable[[str, tuple[int, ...]], np.ndarray]
QuantizedFn = Callable[[str, int, int], QuantizedLinear | None]  # (prefix, out_dim, in_dim) → quantized layer or None


class Linears:
    def __init__(self, g: GraphWriter, np_dtype: type, weights: WeightFn, quantized: QuantizedFn | None = None,
                 accuracy_level: int | None = None, qdq: bool = False) -> None:
        self.g, self.np_dtype, self.weights = g, np_dtype, weights
        self.qdq = qdq  # standard Q/DQ only (the TensorRT targets): no MatMulNBits or integer matmul
        self.quantized = quantized or (lambda *_: None)
        self.accuracy_level = NBITS_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
        self.counts: Counter[str] = Counter()  # quantized layers per lowering kind
        self.dequantized: list[str] = []  # quantized layers no kernel takes, built from their dequantized weights
        self.floats: set[str] = set()  # layers the checkpoint left float

    def float_weight(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """[in, out] weight in the graph's float type."""
        return self.weights(name, shape).T.astype(self.np_dtype)

    def bias(self, y: str, name: str, prefixes: list[str], out_dims: list[int]) -> str:
        b = np.concatenate([self.weights(f"{p}.bias", (o,)) for p, o in zip(prefixes, out_dims, strict=True)])
        return self.g.op("Add", [y, self.g.weight(f"{name}.bias", b.astype(self.np_dtype))])

    def linear(self, x: str, prefix: str, out_dim: int, in_dim: int, bias: bool) -> str:
        q = self.quantized(prefix, out_dim, in_dim)
        if q is None:
            self.floats.add(prefix)
        y = self.lower_quantized(x, [q], prefix, in_dim) if q is not None else None
        if y is None:  # float (a quantized layer no kernel takes comes back dequantized)
            if q is not None:
                self.dequantized.append(prefix)
            y = self.g.op("MatMul", [x, self.g.weight(f"{prefix}.weight",
                                                     self.float_weight(f"{prefix}.weight", (out_dim, in_dim)))])
        return self.bias(y, prefix, [prefix], [out_dim]) if bias else y

    def fused(self, x: str, prefixes: list[str], out_dims: list[int], in_dim: int, bias: bool,
              name: str, split: bool = True) -> list[str]:
        """The layers' outputs; with `split` False, one concatenated output where they fuse into one product."""
        pairs = list(zip(prefixes, out_dims, strict=True))
        quantized = [self.quantized(p, o, in_dim) for p, o in pairs]
        if any(q is not None for q in quantized):
            y = None
            if all(q is not None and _fusable(q, quantized[0]) for q in quantized):
                y = self.lower_quantized(x, quantized, name, in_dim)
            if y is None:  # mixed (e.g. --exclude) or not expressible: one layer at a time
                return [self.linear(x, p, o, in_dim, bias) for p, o in pairs]
        else:
            self.floats.update(prefixes)
            weight = np.concatenate([self.float_weight(f"{p}.weight", (o, in_dim)) for p, o in pairs], axis=1)
            y = self.g.op("MatMul", [x, self.g.weight(f"{name}.weight", weight)])
        if bias:
            y = self.bias(y, name, prefixes, out_dims)
        if not split:
            return [y]
        return self.g.op("Split", [y, self.g.ints(out_dims)], n_out=len(out_dims), axis=-1)

    def lower_quantized(self, x: str, layers: list[QuantizedLinear], name: str, in_dim: int) -> str | None:
        first = layers[0]
        per_channel = first.block_size == in_dim
        if self.qdq:
            kind, y = "qdq", self.qdq_matmul(x, layers, name, in_dim)
        elif first.activation is None and nbits_block(first) is not None:
            kind, y = "nbits", self.matmul_nbits(x, layers, name, in_dim)
        elif first.activation == "int8" and per_channel:
            kind, y = "int8_per_token" if first.per_token else "int8", self.integer_matmul(x, layers, name)
        elif first.activation == "fp8" and first.bits == 8 and per_channel:
            kind, y = "fp8_per_token" if first.per_token else "fp8", self.fp8_matmul(x, layers, name)
        elif first.activation == "fp8" and first.bits == 4:
            kind, y = "w4a8", self.qdq_matmul(x, layers, name, in_dim)
        else:
            return None
        self.counts[kind] += len(layers)
        return y

    def joinable_nbits(self, layers: list[QuantizedLinear | None], in_dim: int) -> bool:
        """Whether these layers (sharing an input) can be one MatMulNBits over their own tensors (`joined`)."""
        first = layers[0]
        return (not self.qdq and first is not None and first.activation is None
                and nbits_block(first) is not None
                and all(q is not None and _fusable(q, first) for q in layers))

    def pre_scale(self, x: str, layer: QuantizedLinear, name: str) -> str:
        if layer.pre_quant_scale is None:
            return x
        return self.g.op("Mul", [x, self.g.weight(f"{name}.pre_quant_scale",
                                                   layer.pre_quant_scale.astype(self.np_dtype))])

    def matmul_nbits(self, x: str, layers: list[QuantizedLinear], name: str, in_dim: int,
                     accuracy_level: int | None = None, joined: list[str] | None = None,
                     tensors: tuple[str, str] | None = None) -> str:
        """x [.., in_dim] @ the layers' dequantized weights (concatenated along the output) as one MatMulNBits.
        With `joined` (one name per layer), each layer keeps its own tensors under that name, as a lone layer would
        be lowered, and a Concat joins them (ONNX Runtime folds it at load); `tensors`: (qweight, scales) already
        written (the nbits_tensors of `layers`)."""
        g, first = self.g, layers[0]
        block = nbits_block(first)
        if tensors is not None:
            qweight, scales = tensors
        elif joined is None:
            qweight, scales = (g.weight(f"{name}.{kind}", t) for kind, t in zip(
                ("qweight", "scales"), self.nbits_tensors(layers, block), strict=True))
        else:
            parts = [self.nbits_tensors([q], block) for q in layers]
            qweight, scales = (g.op("Concat", [g.weight(f"{n}.{kind}", part[i]) for n, part in zip(joined, parts,
                                                                                                  strict=True)],
                                    axis=0) for i, kind in enumerate(("qweight", "scales")))
        x = self.pre_scale(x, first, name)
        return g.op("MatMulNBits", [x, qweight, scales], domain=MS_DOMAIN, K=in_dim,
                    N=sum(len(q.values) for q in layers), bits=first.bits, block_size=block,
                    accuracy_level=self.accuracy_level if accuracy_level is None else accuracy_level)

    def nbits_tensors(self, layers: list[QuantizedLinear], block: int) -> tuple[np.ndarray, np.ndarray]:
        """MatMulNBits' packed weight [N, K / block, block * bits / 8] and flat scales for layers stacked along N."""
        first = layers[0]
        values = np.concatenate([q.values for q in layers], axis=0)  # [N, K] signed
        scales = np.concatenate([np.repeat(q.scales, (q.block_size // block), axis=1) for q in layers], axis=0)
        n, k = values.shape
        unsigned = (values.astype(np.int16) + (1 << (first.bits - 1))).astype(np.uint8)  # default zero point
        unsigned = unsigned.reshape(n, k // block, block)
        if first.bits == 4:  # two consecutive K elements a byte, the first in the low nibble
            packed = unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)
        else:
            packed = unsigned
        return np.ascontiguousarray(packed), scales.astype(self.np_dtype).reshape(-1)

    def integer_matmul(self, x: str, layers: list[QuantizedLinear], name: str) -> str:
        g, first = self.g, layers[0]
        x = self.pre_scale(x, first, name)
        zero = g.const(np.array(128, dtype=np.uint8), "zero_point")
        if first.per_token:
            xq, token_scale = int8_per_token(self.g, x, self.np_dtype)
        else:
            xq = g.op("QuantizeLinear", [x, g.const(np.array(first.input_scale, dtype=self.np_dtype), "input_scale"),
                                         zero])
        values = np.concatenate([q.values for q in layers], axis=0).T  # [K, N] int8
        y = g.op("Cast", [g.op("MatMulInteger", [xq, g.weight(f"{name}.qweight", values), zero])], to=TensorProto.FLOAT)
        scales = np.concatenate([q.scales[:, 0] for q in layers])
        if first.per_token:
            y = g.op("Mul", [g.op("Mul", [y, token_scale]), g.weight(f"{name}.weight_scale", scales)])
        else:
            y = g.op("Mul", [y, g.weight(f"{name}.output_scale", scales * np.float32(first.input_scale))])
        if self.np_dtype != np.float32:  # int32 sums overflow float16: scale in float32 first
            y = g.op("Cast", [y], to=ONNX_DTYPES[np.dtype(self.np_dtype).name])
        return y

    def qdq_matmul(self, x: str, layers: list[QuantizedLinear], name: str, in_dim: int) -> str:
        """Any format as standard ONNX: the input Q→DQ'd as its format says (int8 or float8, static scale), the
        weight [K, N] through DequantizeLinear (int4 in blocks along K, int8 per column, float8), W4A8's weight then
        rounded to float8; MatMul."""
        g, first = self.g, layers[0]
        if first.values.dtype == FP8:
            return self.fp8_matmul(x, layers, name)
        x = self.pre_scale(x, first, name)
        if first.activation == "int8" and first.per_token:
            xq, inverse = int8_per_token(g, x, self.np_dtype)
            offset = g.const(np.array(128.0, dtype=np.float32), "uint8_offset_f32")
            x = g.op("Mul", [g.op("Sub", [g.op("Cast", [xq], to=TensorProto.FLOAT), offset]), inverse])
            if self.np_dtype != np.float32:
                x = g.op("Cast", [x], to=ONNX_DTYPES[np.dtype(self.np_dtype).name])
        elif first.activation == "int8":
            s = g.const(np.array(first.input_scale, dtype=self.np_dtype), "input_scale")
            z = g.const(np.zeros((), np.int8), "int8_zero_point")
            x = g.op("DequantizeLinear", [g.op("QuantizeLinear", [x, s, z]), s, z])
        elif first.activation == "fp8":
            x = fp8_round(g, x, np.array(first.input_scale, dtype=self.np_dtype), "input_scale", self.np_dtype)
        values = np.concatenate([q.values for q in layers], axis=0).T  # [K, N]
        if first.block_size == in_dim and first.bits == 8:
            scales = np.concatenate([q.scales[:, 0] for q in layers]).astype(self.np_dtype)
            w = g.op("DequantizeLinear", [g.weight(f"{name}.qweight", values), g.weight(f"{name}.scales", scales)],
                     axis=1)
        else:
            scales = np.concatenate([q.scales for q in layers], axis=0).T.astype(self.np_dtype)  # [K / block, N]
            w = g.op("DequantizeLinear", [g.weight(f"{name}.qweight", values.astype(ml_dtypes.int4)),
                                          g.weight(f"{name}.scales", scales)], axis=0, block_size=first.block_size)
        if first.weight_scale_2 is not None:
            scale_2 = np.concatenate([np.full(len(q.values), q.weight_scale_2) for q in layers])
            w = fp8_round(g, w, scale_2.astype(self.np_dtype), f"{name}.weight_scale_2", self.np_dtype)
        return g.op("MatMul", [x, w])

    def fp8_input(self, x: str, first: QuantizedLinear, name: str) -> str:
        """The input as the fake-quant layer sees it: pre-scaled, then rounded to float8 with its static scale (or
        each token with its own)."""
        x = self.pre_scale(x, first, name)
        if first.per_token:
            return fp8_round_per_token(self.g, x, self.np_dtype)
        return fp8_round(self.g, x, np.array(first.input_scale, dtype=self.np_dtype), "input_scale", self.np_dtype)

    def fp8_matmul(self, x: str, layers: list[QuantizedLinear], name: str) -> str:
        """FP8: input Q→DQ with its static scale; float8 weights [K, N] through DequantizeLinear with one scale per
        output channel (per tensor when they are all equal); MatMul."""
        g = self.g
        x = self.fp8_input(x, layers[0], name)
        values = np.concatenate([q.values for q in layers], axis=0).T  # [K, N] float8
        scales = np.concatenate([q.scales[:, 0] for q in layers]).astype(self.np_dtype)
        weight = g.weight(f"{name}.qweight", values)
        if np.all(scales == scales[0]):
            w = g.op("DequantizeLinear", [weight, g.const(scales[:1].reshape(()), "weight_scale")])
        else:
            w_zero = g.weight(f"{name}.weight_zero_point", np.zeros(len(scales), dtype=ml_dtypes.float8_e4m3fn))
            w = g.op("DequantizeLinear", [weight, g.weight(f"{name}.weight_scale", scales), w_zero], axis=1)
        return g.op("MatMul", [x, w])


def nbits_block(q: QuantizedLinear) -> int | None:
    """MatMulNBits block size for a layer: the largest allowed block dividing its own (per-channel scales: in_dim),
    its scales repeated over the smaller blocks, so a group of 256 is exact in blocks of 128. None when MatMulNBits
    cannot express the layer."""
    return next((b for b in NBITS_BLOCK_SIZES if q.block_size % b == 0), None)


def _fusable(q: QuantizedLinear, first: QuantizedLinear) -> bool:
    return ((q.bits, q.block_size, q.activation, q.input_scale, q.per_token, q.values.dtype)
            == (first.bits, first.block_size, first.activation, first.input_scale, first.per_token, first.values.dtype)
            and _same(q.pre_quant_scale, first.pre_quant_scale))


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
