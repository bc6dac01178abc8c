"""The one quantization vocabulary: formats, KV cache dtypes and group sizes, validated before any work.

A `QuantSpec` names what the user asked for; `modelopt_config` turns it into the ModelOpt config that calibrates it,
and the builder reads the same names back from the checkpoint's hf_quant_config.json.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from camshaft.checks import is_int
from camshaft.errors import CamshaftError
from camshaft.model_config import ModelConfig


class QuantizeError(CamshaftError):
    """Quantization options, calibration data or the quantization run itself are invalid."""


# --lm-head → inputs per scale block (None: one scale per vocabulary row); the builder rounds the head at build time.
LM_HEAD_BLOCKS: dict[str, int | None] = {"float": None, "int8": None, "int4": 64}
LM_HEAD_DTYPES = tuple(LM_HEAD_BLOCKS)
LEAST_NBITS_BLOCK = 16  # a quantized head runs as MatMulNBits, in blocks of 16 to 128 inputs
# --lm-head → how many of the head's input channels stay float: those with the largest mean |input| over the
# calibration tokens (`camshaft quantize` records them). A few channels of the final hidden states are ~10-40x the
# rest (SmolLM2: one at 40x the median) and dominate the int4 head's error; kept float, blocks of 64 are more
# accurate than blocks of 32 without them, at about the same speed (BENCHMARKS.md, docs/quantize.md "lm_head policy").
LM_HEAD_FLOAT_CHANNELS: dict[str, int] = {"float": 0, "int8": 0, "int4": 8}


def check_lm_head(lm_head: str, config: ModelConfig, error: type[CamshaftError] = QuantizeError) -> None:
    """Refuse a head format the model cannot take (unknown name, block not dividing the hidden size)."""
    if lm_head not in LM_HEAD_BLOCKS:
        raise error(f"unknown --lm-head {lm_head!r}; choose one of: {', '.join(LM_HEAD_DTYPES)}")
    block = LM_HEAD_BLOCKS[lm_head]
    fits_int8 = config.hidden_size % LEAST_NBITS_BLOCK == 0
    if block is not None and config.hidden_size % block:
        raise error(f"--lm-head {lm_head} quantizes blocks of {block} inputs, which do not divide "
                    f"hidden_size {config.hidden_size}; use --lm-head {'int8 or float' if fits_int8 else 'float'}")
    if lm_head == "int8" and not fits_int8:
        raise error(f"--lm-head int8 runs in blocks of {LEAST_NBITS_BLOCK} to 128 inputs (ONNX Runtime's "
                    f"MatMulNBits), none of which divides hidden_size {config.hidden_size}; use --lm-head float")


@dataclass(frozen=True)
class FormatInfo:
    modelopt_config: str  # the name of the config in modelopt.torch.quantization
    description: str
    weight_bits: int
    blockwise: bool  # weights scaled per block of `group_size` input channels
    checkpoint_algo: str  # hf_quant_config.json's quant_algo for this format
    algorithm: dict[str, Any] | None = None  # replaces the named config's "algorithm" (None: keep it)
    per_token_inputs: bool = False  # after calibration, each layer's input is quantized per token at run time
    weight_only_layers: tuple[str, ...] = ()  # module patterns whose inputs stay float (their weights int8: W8A16)
    mixed_algos: tuple[str, ...] = ()  # with weight_only_layers: the per-layer quant_algos of its MIXED_PRECISION

    @property
    def layer_algos(self) -> tuple[str, ...]:
        """The quant_algos the checkpoint's layers carry (one, unless the format is mixed)."""
        return self.mixed_algos or (self.checkpoint_algo,)


# SmoothQuant's migration strength per format, each the best on a validation text that is neither the calibration
# corpus nor the held-out text of the accuracy table (docs/quantize.md): fake-quant models at 0.5-1.0 in steps of 0.1
# (scripts/sweep_smoothquant.py) for the first two, engines at 0.6-1.0 for int8_sq_mixed
SMOOTHQUANT_ALPHA = 0.8  # static per-tensor inputs: +4.97 % there (ModelOpt's default 1.0: +14.6 %)
SMOOTHQUANT_PER_TOKEN_ALPHA = 0.7  # per-token inputs: +0.22 %
SMOOTHQUANT_MIXED_ALPHA = 0.9  # int8_sq_mixed: +0.22 % (0.6-1.0: +1.31 / 1.21 / 0.86 / 0.22 / 2.37 %)
FORMATS: dict[str, FormatInfo] = {
    "fp8": FormatInfo("FP8_DEFAULT_CFG", "FP8 e4m3 weights and activations, per-tensor scales", 8, False, "FP8"),
    "fp8_pc_pt": FormatInfo("FP8_PER_CHANNEL_PER_TOKEN_CFG", "FP8 e4m3 weights per output channel, activations "
                            "per token (scales computed at run time)", 8, False, "FP8_PER_CHANNEL_PER_TOKEN"),
    "int8_sq": FormatInfo("INT8_SMOOTHQUANT_CFG", "INT8 weights and activations with SmoothQuant", 8, False,
                          "W8A8_SQ_PER_CHANNEL", {"method": "smoothquant", "alpha": SMOOTHQUANT_ALPHA}),
    # TensorRT-LLM's SmoothQuant with per-token activations (its quant_algo name): smoothed with ModelOpt, then each
    # input row gets its own scale at run time, so the smoothing only has to tame channels, not tokens
    "int8_sq_pt": FormatInfo("INT8_SMOOTHQUANT_CFG", "INT8 weights per output channel with SmoothQuant, activations "
                             "per token (scales computed at run time)", 8, False,
                             "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
                             {"method": "smoothquant", "alpha": SMOOTHQUANT_PER_TOKEN_ALPHA}, per_token_inputs=True),
    # int8_sq's loss on SmolLM2 is the down_proj inputs (SwiGLU products) of every layer: those layers keep float
    # inputs and int8 weights (W8A16); static scales throughout, so TensorRT builds it (docs/quantize.md)
    "int8_sq_mixed": FormatInfo("INT8_SMOOTHQUANT_CFG", "INT8 weights and activations with SmoothQuant, except "
                                "down_proj: INT8 weights, float activations (W8A16)", 8, False, "MIXED_PRECISION",
                                {"method": "smoothquant", "alpha": SMOOTHQUANT_MIXED_ALPHA},
                                weight_only_layers=("*.mlp.down_proj",),
                                mixed_algos=("W8A8_SQ_PER_CHANNEL", "W8A16")),
    "int8_wo": FormatInfo("INT8_WEIGHT_ONLY_CFG", "INT8 weights, per output channel scales", 8, False, "W8A16"),
    "int4_wo": FormatInfo("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT4 weights, blockwise scales (round to nearest)", 4,
                          True, "W4A16_AWQ"),
    "int4_awq": FormatInfo("INT4_AWQ_CFG", "INT4 weights, blockwise scales, AWQ", 4, True, "W4A16_AWQ"),
    "w4a8_awq": FormatInfo("W4A8_AWQ_BETA_CFG", "INT4 weights (AWQ) with FP8 activations", 4, True, "W4A8_AWQ"),
}
# Per-tensor scales after a static per-channel bias (ModelOpt's affine KV: the running mean of each K/V channel per
# KV head over the calibration batches, subtracted before quantizing and added back after). Measured on SmolLM2
# fake-quant perplexity (docs/quantize.md): fp8 +2.3 % → +0.8 %, int8 +1.1 % → +0.7 % over the float cache.
KV_AFFINE_BIAS = {-2: None, -4: None, "type": "static"}
KV_CACHE_DTYPES: dict[str, dict[str, Any]] = {
    "fp8": {"num_bits": (4, 3), "axis": None, "bias": KV_AFFINE_BIAS},
    "int8": {"num_bits": 8, "axis": None, "bias": KV_AFFINE_BIAS},
}
GROUP_SIZES = (128, 64, 32)  # what ONNX Runtime's MatMulNBits and TensorRT accept; largest first


@dataclass(frozen=True)
class QuantSpec:
    format: str
    kv_cache_dtype: str | None = None
    group_size: int | str = "auto"  # "auto" or one of GROUP_SIZES; only for blockwise formats
    exclude: str | Sequence[str] | None = ()  # fnmatch patterns over module names ("*.mlp.down_proj"), kept a tuple
    lm_head: str = "float"  # or int8 / int4: rounded to nearest when the engine is built (ModelOpt leaves it float)

    def __post_init__(self) -> None:
        for name in ("format", "lm_head", "kv_cache_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) and (value is not None or name != "kv_cache_dtype"):
                raise QuantizeError(f"QuantSpec.{name} is a name (a string), got {getattr(self, name)!r:.80}")
        if self.format not in FORMATS:
            raise QuantizeError(
                f"unknown quantization format {self.format!r}; choose one of: "
                + ", ".join(f"{name} ({info.description})" for name, info in FORMATS.items())
            )
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise QuantizeError(
                f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose one of: {', '.join(KV_CACHE_DTYPES)}"
            )
        group = self.group_size
        if not isinstance(group, str) and not is_int(group):
            raise QuantizeError(f"--group-size is 'auto' or an integer, got {group!r:.80}")
        if group != "auto":  # an int (numpy's too) or a number written as text
            try:
                group = int(group)
            except ValueError:
                raise QuantizeError(f"--group-size {group!r} is not 'auto' or a number") from None
            object.__setattr__(self, "group_size", group)
        if group != "auto":
            if group not in GROUP_SIZES:
                raise QuantizeError(f"--group-size {group} is not supported; choose auto or one of {GROUP_SIZES}")
            if not self.info.blockwise:
                raise QuantizeError(
                    f"--group-size applies only to blockwise formats "
                    f"({', '.join(n for n, i in FORMATS.items() if i.blockwise)}), not {self.format}"
                )
        if self.lm_head not in LM_HEAD_DTYPES:
            raise QuantizeError(f"unknown --lm-head {self.lm_head!r}; choose one of: {', '.join(LM_HEAD_DTYPES)}")
        # one pattern or several (a string is one pattern, not its characters); None: none
        if self.exclude is not None and not isinstance(self.exclude, str | Iterable):
            raise QuantizeError(f"exclude is a pattern or a list of them (e.g. [\"*.mlp.down_proj\"]), got "
                                f"{self.exclude!r:.80}")
        exclude = () if self.exclude is None else (self.exclude,) if isinstance(self.exclude, str) else \
            tuple(self.exclude)
        for pattern in exclude:
            if not isinstance(pattern, str):
                raise QuantizeError(f"an --exclude pattern is a string (fnmatch), got {pattern!r:.80}")
            if not pattern or not pattern.strip():
                raise QuantizeError("an --exclude pattern is empty")
        object.__setattr__(self, "exclude", exclude)

    @property
    def info(self) -> FormatInfo:
        return FORMATS[self.format]

    def excludes(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in self.exclude)


def linear_input_dims(model: ModelConfig) -> dict[str, int]:
    """Input dimension of every kind of quantized linear layer (the block size must divide each)."""
    return {
        "q/k/v_proj, gate/up_proj (hidden_size)": model.hidden_size,
        "o_proj (num_heads * head_dim)": model.num_heads * model.head_dim,
        "down_proj (intermediate_size)": model.intermediate_size,
    }


def resolve_group_size(spec: QuantSpec, model: ModelConfig) -> int | None:
    """The block size for a blockwise format (None otherwise): auto → the largest of 128/64/32 dividing every input
    dimension; an explicit size must divide them all. Refused here, before any calibration."""
    if not spec.info.blockwise:
        return None
    dims = linear_input_dims(model)
    if spec.group_size == "auto":
        for size in GROUP_SIZES:
            if all(d % size == 0 for d in dims.values()):
                return size
        raise QuantizeError(
            f"no supported group size ({', '.join(map(str, GROUP_SIZES))}) divides every linear input dimension "
            f"of this model ({', '.join(f'{k}={v}' for k, v in dims.items())}); {spec.format} needs one"
        )
    bad = {k: v for k, v in dims.items() if v % spec.group_size}
    if bad:
        fits = [s for s in GROUP_SIZES if all(d % s == 0 for d in dims.values())]
        raise QuantizeError(
            f"group size {spec.group_size} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())}; "
            + (f"use --group-size {fits[0]} (or auto)" if fits else "no supported group size fits this model")
        )
    return int(spec.group_size)


def check_lm_head_fits(spec: QuantSpec, model: ModelConfig) -> None:
    """Refuse an --lm-head the model cannot take before calibration (the builder would refuse it after)."""
    check_lm_head(spec.lm_head, model)


def modelopt_config(spec: QuantSpec, group_size: int | None) -> dict[str, Any]:
    """The ModelOpt quantization config for a spec: its named config with the block size, the KV cache quantizers
    and the excluded modules applied (later entries of quant_cfg override earlier ones)."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, spec.info.modelopt_config))
    if spec.info.algorithm is not None:
        cfg["algorithm"] = dict(spec.info.algorithm)
    entries = cfg["quant_cfg"]
    if group_size is not None:
        for entry in entries:
            parts = entry.get("cfg")
            for part in parts if isinstance(parts, list) else [parts]:
                if isinstance(part, dict) and isinstance(part.get("block_sizes"), dict) and -1 in part["block_sizes"]:
                    part["block_sizes"][-1] = group_size
    if spec.kv_cache_dtype is not None:
        entries.append({"quantizer_name": "*[kv]_bmm_quantizer",
                        "cfg": copy.deepcopy(KV_CACHE_DTYPES[spec.kv_cache_dtype])})
    for pattern in spec.info.weight_only_layers:
        entries.append({"quantizer_name": f"{pattern}*input_quantizer", "enable": False})
    for pattern in spec.exclude:  # a linear layer's own quantizers, not the KV cache's (the attention module's)
        entries.extend({"quantizer_name": f"{pattern}*.{kind}_quantizer", "enable": False}
                       for kind in ("input", "weight", "output"))
    return cfg
