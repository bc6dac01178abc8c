"""What a ModelOpt-quantized checkpoint's hf_quant_config.json (or config.json's quantization_config) says of its
layers, and their quantized weights read back (Checkpoint's quantization view)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from camshaft.builder.quantized import FP8, KV_CACHE_ALGOS, MIXED, READABLE_QUANT_ALGOS, QuantizedLinear
from camshaft.errors import CheckpointError
from camshaft.model_config import HF_QUANT_CONFIG, ModelConfig


class QuantizedView:
    dir: Path
    config: ModelConfig
    quantization: dict[str, Any] | None
    _where: dict[str, Path]
    _modules: dict[str, str]
    _raw: Callable[[str], np.ndarray]
    get: Callable[[str, tuple[int, ...]], np.ndarray]
    _finite: Callable[[str, np.ndarray], np.ndarray]
    _not_finite: Callable[[str], CheckpointError]

    def _layer_entry(self, prefix: str) -> dict[str, Any]:
        """What hf_quant_config.json says of linear layer `prefix`: its own entry in a MIXED_PRECISION checkpoint
        (empty for a float layer), else the checkpoint's section."""
        quant = self.quantization or {}
        if quant.get("quant_algo") != MIXED:
            return quant
        return quant["quantized_layers"].get(self._modules.get(prefix, prefix)) or {}

    def layer_algo(self, prefix: str) -> str | None:
        """The quant_algo of linear layer `prefix`; None if it is float."""
        return self._layer_entry(prefix).get("quant_algo")

    @property
    def quant_algos(self) -> list[str]:
        """Every quant_algo the checkpoint's layers use (one, unless it is MIXED_PRECISION); [] if they are float
        (a checkpoint may quantize its KV cache only)."""
        quant = self.quantization or {}
        if quant.get("quant_algo") != MIXED:
            return [quant["quant_algo"]] if quant.get("quant_algo") else []
        return sorted({v["quant_algo"] for v in quant["quantized_layers"].values()})

    @property
    def lm_head(self) -> str:
        """The lm_head dtype `camshaft quantize --lm-head` recorded (float for any other checkpoint)."""
        return str(((self.quantization or {}).get("camshaft") or {}).get("lm_head", "float"))

    @property
    def quantizes_head(self) -> bool:
        """The checkpoint stores lm_head quantized (a quantizer not told to leave it float, as ModelOpt does)."""
        return self.layer_algo("lm_head") is not None and "lm_head.weight_scale" in self._where

    @property
    def lm_head_float_channels(self) -> tuple[int, ...]:
        """The head's input channels `camshaft quantize` recorded to keep float (the builder checks them)."""
        channels = ((self.quantization or {}).get("camshaft") or {}).get("lm_head_float_channels") or ()
        return tuple(channels) if isinstance(channels, list | tuple) else ()

    @property
    def kv_cache_dtype(self) -> str | None:
        """The KV pool's element type for a checkpoint with a quantized KV cache (int8 or float8), else None."""
        algo = (self.quantization or {}).get("kv_cache_quant_algo")
        return KV_CACHE_ALGOS[algo] if algo else None

    def kv_scales(self, layer: int) -> tuple[float, float]:
        """Layer `layer`'s K and V cache scales (ModelOpt: amax / 448 for FP8, amax / 127 for INT8), named
        `self_attn.k_proj.k_scale` (ModelOpt's unified export) or `self_attn.k_scale` (vLLM's convention)."""
        p = f"model.layers.{layer}.self_attn"
        names = [(f"{p}.{kind}_proj.{kind}_scale", f"{p}.{kind}_scale") for kind in "kv"]
        missing = [pair for pair in names if not any(n in self._where for n in pair)]
        if missing:
            key = "kv_cache_scheme" if self._from_config else "kv_cache_quant_algo"
            raise CheckpointError(
                f"{self.dir} quantizes the KV cache ({key} in {self._quant_file}) but holds no "
                f"{missing[0][0]} (nor {missing[0][1]}): its scales come from calibration; quantize with `camshaft "
                f"quantize --kv-cache-dtype ...`, or remove {key} to build a float cache")
        k, v = (self._scalar(next(n for n in pair if n in self._where)) for pair in names)
        return k, v

    def kv_biases(self, layer: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Layer `layer`'s affine K and V cache biases ([kv_heads * head_dim], subtracted before quantizing and added
        back after), named `self_attn.k_proj.k_bias` as ModelOpt's export names them; None where absent."""
        p = f"model.layers.{layer}.self_attn"
        channels = self.config.num_kv_heads * self.config.head_dim
        out = []
        for kind in "kv":
            name = f"{p}.{kind}_proj.{kind}_bias"
            if name not in self._where:
                out.append(None)
                continue
            bias = self._raw(name).astype(np.float32).reshape(-1)
            if bias.size != channels or not np.isfinite(bias).all():
                raise CheckpointError(f"{name} must hold {channels} finite values (kv_heads x head_dim), got "
                                      f"{bias.size}")
            out.append(bias)
        return out[0], out[1]

    @property
    def _from_config(self) -> bool:
        """Whether the quantization was read from config.json's quantization_config (no hf_quant_config.json)."""
        return (self.quantization or {}).get("source") == "config.json"

    @property
    def _quant_file(self) -> str:
        return "config.json's quantization_config" if self._from_config else HF_QUANT_CONFIG

    def quantized_linear(self, prefix: str, out_dim: int, in_dim: int) -> QuantizedLinear | None:
        """The quantized weights of linear layer `prefix` (None when the layer is not quantized)."""
        algo = self.layer_algo(prefix)
        if algo is None or f"{prefix}.weight_scale" not in self._where:
            return None
        fmt = READABLE_QUANT_ALGOS[algo]
        packed = self._raw(f"{prefix}.weight")
        scale = self._finite(f"{prefix}.weight_scale", self._raw(f"{prefix}.weight_scale").astype(np.float32))
        if np.any(scale < 0):
            raise CheckpointError(f"{prefix}.weight_scale holds negative scales; quantization scales are a largest "
                                  "magnitude over the largest code, never below 0: the checkpoint is damaged")
        if packed.dtype == FP8 and np.any((packed.view(np.uint8) & 0x7F) == 0x7F):  # e4m3fn's NaN codes
            raise self._not_finite(f"{prefix}.weight")
        if fmt.weight_bits == 4:
            block = self._layer_entry(prefix).get("group_size", self.quantization.get("group_size"))
            if not isinstance(block, int) or isinstance(block, bool) or block < 1 or in_dim % block:
                raise CheckpointError(f"hf_quant_config.json's group_size for {prefix} is {block!r}: int4 weights "
                                      f"need a positive group size that divides their {in_dim} inputs")
            if packed.dtype == np.int8:  # older ModelOpt exports wrote the same bytes as int8
                packed = packed.view(np.uint8)
            expected = {"weight": ((out_dim // 2, in_dim), np.uint8), "weight_scale": ((out_dim, in_dim // block),)}
            self._check_quantized(prefix, packed, scale, expected)
            # ModelOpt packs output rows 2j (low nibble) and 2j+1 (high nibble) into one byte.
            low = (packed & 0x0F).astype(np.int8)
            high = (packed >> 4).astype(np.int8)
            values = np.empty((out_dim, in_dim), dtype=np.int8)
            values[0::2], values[1::2] = (low ^ 8) - 8, (high ^ 8) - 8
        elif fmt.weight_type == "fp8":  # one scale for the tensor, or (per token formats) one per output channel
            block = in_dim
            rows = out_dim if fmt.per_token else 1
            scale = scale.reshape(-1) if scale.size == rows else scale
            expected = {"weight": ((out_dim, in_dim), FP8), "weight_scale": ((rows,),)}
            self._check_quantized(prefix, packed, scale, expected)
            values, scale = packed, np.broadcast_to(scale.reshape(-1, 1), (out_dim, 1)).astype(np.float32)
        else:
            block = in_dim
            scale = scale.reshape(-1) if scale.size == out_dim else scale  # [out] or [out, 1], as fp8's
            expected = {"weight": ((out_dim, in_dim), np.int8), "weight_scale": ((out_dim,),)}
            self._check_quantized(prefix, packed, scale, expected)
            values, scale = packed, scale.reshape(out_dim, 1)
        pqs = None
        if f"{prefix}.pre_quant_scale" in self._where:
            pqs = self.get(f"{prefix}.pre_quant_scale", (in_dim,))
        input_scale = self._scalar(f"{prefix}.input_scale") if fmt.activation and not fmt.per_token else None
        needs_2 = fmt.weight_bits == 4 and fmt.activation == "fp8"  # W4A8: its int4 scales are float8 times this
        scale_2 = self._scalar(f"{prefix}.weight_scale_2") if needs_2 or f"{prefix}.weight_scale_2" in self._where \
            else None
        return QuantizedLinear(fmt.weight_bits, block, values, scale, pqs, fmt.activation, input_scale, scale_2,
                               fmt.per_token)

    def _scalar(self, name: str) -> float:
        value = self._raw(name)
        if value.size != 1 or not np.isfinite(value).all() or float(value.reshape(-1)[0]) <= 0:
            raise CheckpointError(f"{name} must be one positive scale, got {value.dtype}{tuple(value.shape)}")
        return float(value.reshape(-1)[0])

    def _check_quantized(self, prefix: str, weight: np.ndarray, scale: np.ndarray, expected: dict) -> None:
        shape, dtype = expected["weight"]
        if tuple(weight.shape) != shape or weight.dtype != dtype:
            raise CheckpointError(
                f"{prefix}.weight is {weight.dtype}{tuple(weight.shape)}, expected {np.dtype(dtype)}{shape} for "
                f"{self.layer_algo(prefix)}"
            )
        if tuple(scale.shape) != expected["weight_scale"][0]:
            raise CheckpointError(
                f"{prefix}.weight_scale has shape {tuple(scale.shape)}, expected {expected['weight_scale'][0]}"
            )
