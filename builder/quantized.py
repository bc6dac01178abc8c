"""What the builder reads from quantized checkpoints: each quant_algo's storage, one quantized linear layer, and the
float8 tensors of safetensors files (safetensors' numpy reader cannot return them); quant_config.py reads
hf_quant_config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # also registers bfloat16 with numpy so safetensors can return it
import numpy as np

from camshaft.quantize.spec import LM_HEAD_BLOCKS

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint's quant_algo stores a linear layer."""

    weight_bits: int
    weight_type: str  # "int" (signed integers) or "fp8" (float8 e4m3fn)
    activation: str | None  # None: weight-only; "int8" / "fp8": the input is quantized with a static per-tensor scale
    blockwise: bool  # weight scales per block of group_size input channels (else per output channel or tensor)
    per_token: bool = False  # the input's scale is computed per token at run time (no input_scale)


# ModelOpt's quant_algo for a checkpoint whose layers differ; each layer's own is in "quantized_layers".
MIXED = "MIXED_PRECISION"

# hf_quant_config.json quant_algo → storage, for the formats the builder lowers. Others are refused clearly.
READABLE_QUANT_ALGOS = {
    "W4A16_AWQ": QuantFormat(4, "int", None, True),
    "W8A16": QuantFormat(8, "int", None, False),
    "FP8": QuantFormat(8, "fp8", "fp8", False),
    "FP8_PER_CHANNEL_PER_TOKEN": QuantFormat(8, "fp8", "fp8", False, per_token=True),
    "W8A8_SQ_PER_CHANNEL": QuantFormat(8, "int", "int8", False),
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": QuantFormat(8, "int", "int8", False, per_token=True),
    "W4A8_AWQ": QuantFormat(4, "int", "fp8", True),  # INT4 blocks, then float8 per tensor (weight_scale_2)
}


@dataclass(frozen=True)
class HeadFormat:
    """lm_head weights rounded to nearest at build time (ModelOpt leaves lm_head float)."""

    bits: int
    block_size: int | None  # None: one scale per output row (vocabulary entry)
    accuracy_level: int | None  # MatMulNBits accuracy level; None: the engine's


# --lm-head → its format. INT8 computes at accuracy level 4 (int8 activations per block): ONNX Runtime 1.32's 8-bit
# float-compute path is ~100x slower (head of SmolLM2: 147 ms vs 1.5 ms a token). Per-row INT8 because TensorRT
# takes blocked scales for INT4 only.
LM_HEAD_FORMATS = {"int8": HeadFormat(8, LM_HEAD_BLOCKS["int8"], 4),
                   "int4": HeadFormat(4, LM_HEAD_BLOCKS["int4"], None)}

# kv_cache_quant_algo → the KV pool's element type (float8: e4m3fn bit patterns); scales k_proj.k_scale / v_proj.v_scale
KV_CACHE_ALGOS = {"FP8": "float8", "INT8": "int8"}


@dataclass(frozen=True)
class QuantizedLinear:
    """One quantized linear layer: integer or float8 values and per-block scales (per output channel when
    block_size == in_dim); `pre_quant_scale` (AWQ, SmoothQuant, when not folded into a norm) multiplies the layer's
    input; with `activation` the input is also quantized (per tensor, `input_scale`; or with `per_token`, each
    token by its own largest magnitude) before the product."""

    bits: int
    block_size: int
    values: np.ndarray  # [out, in] int8 in [-2^(bits-1), 2^(bits-1) - 1], or float8_e4m3fn
    scales: np.ndarray  # [out, in // block_size] float32
    pre_quant_scale: np.ndarray | None = None  # [in] float32
    activation: str | None = None  # None, "int8" or "fp8"
    input_scale: float | None = None
    weight_scale_2: float | None = None  # W4A8: the INT4-dequantized weight is then rounded to float8 with it
    per_token: bool = False

    def weight(self) -> np.ndarray:
        """[out, in] float32: the quantized weight (what ModelOpt's weight quantizer returns)."""
        weight = self.values.astype(np.float32) * np.repeat(self.scales, self.block_size, axis=1)
        if self.weight_scale_2 is not None:
            weight = (weight / np.float32(self.weight_scale_2)).astype(FP8).astype(np.float32)
            weight = weight * np.float32(self.weight_scale_2)
        return weight

    def dequantize(self) -> np.ndarray:
        """[out, in] float32 weights as the layer applies them (pre_quant_scale folded into the input columns)."""
        weight = self.weight()
        if self.pre_quant_scale is not None:
            weight = weight * self.pre_quant_scale[None, :]
        return weight


def round_to_nearest(weight: np.ndarray, bits: int, block_size: int, full_range: bool) -> QuantizedLinear:
    """[out, in] float weights → signed integers with one scale per block of `block_size` inputs.
    full_range: the block's largest-magnitude value maps to −2^(bits−1) exactly (the scale takes its sign), all 2^bits
    levels used, as ONNX Runtime's symmetric MatMulNBits quantizer does (SmolLM2's int4 head: perplexity 12.61 vs
    13.44); else scale = amax / (2^(bits−1) − 1), ModelOpt's form, positive as TensorRT's parser requires."""
    out_dim, in_dim = weight.shape
    low = -(1 << (bits - 1))
    blocks = weight.astype(np.float32).reshape(out_dim, in_dim // block_size, block_size)
    if full_range:
        extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0] / low
    else:
        extreme = np.abs(blocks).max(axis=-1) / (-low - 1)
    scales = np.where(extreme != 0, extreme, 1).astype(np.float32)
    values = np.clip(np.rint(blocks / scales[..., None]), low, -low - 1).astype(np.int8)
    return QuantizedLinear(bits, block_size, values.reshape(out_dim, in_dim), scales)


def fp8_tensors(file: Path) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """The F8_E4M3 tensors of a safetensors file (its header: 8-byte length, then JSON): shape and byte range."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {name: (tuple(info["shape"]), 8 + size + info["data_offsets"][0], 8 + size + info["data_offsets"][1])
            for name, info in header.items() if isinstance(info, dict) and info.get("dtype") == "F8_E4M3"}


def read_fp8(file: Path, shape: tuple[int, ...], start: int, end: int) -> np.ndarray:
    with open(file, "rb") as f:
        f.seek(start)
        raw = f.read(end - start)
    return np.frombuffer(raw, dtype=FP8).reshape(shape).copy()
