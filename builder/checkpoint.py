"""Reading Hugging Face checkpoint directories: config, (sharded) safetensors, tokenizer files."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from camshaft.builder.checkpoint_sizes import check_sizes, fused_parts
from camshaft.builder.checkpoint_tensors import check_tensors
from camshaft.builder.quantized import (  # noqa: F401  (QuantizedLinear and FP8 are part of this module's API)
    FP8,
    KV_CACHE_ALGOS,
    MIXED,
    READABLE_QUANT_ALGOS,
    QuantizedLinear,
    fp8_tensors,
    read_fp8,
    read_quant_config,
)
from camshaft.errors import CheckpointError
from camshaft.hf_config import FUSED_ARCHITECTURES
from camshaft.model_config import HF_QUANT_CONFIG, TOKENIZER_FILES, ModelConfig, missing_checkpoint, require_tokenizer
from camshaft.weight_files import EMBED, index_map, stored_float_dtype, weight_files


class Checkpoint:
    """Tensors by name across one or many safetensors files, each checked against its expected shape."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(missing_checkpoint(self.dir))
        self.config = ModelConfig.from_hf_dir(self.dir)
        self.files = weight_files(self.dir)
        self._stack = ExitStack()
        self._where: dict[str, Path] = {}
        self._aliases: dict[str, str] = {}  # a name read as another tensor
        self._handles = {}
        self._fp8: dict[str, tuple[tuple[int, ...], int, int]] = {}  # name → shape, start, end (safetensors F8_E4M3)
        self._rows: dict[str, tuple[str, int, int]] = {}  # a layer's weight stored as rows of a fused one (Phi-3)
        for file in self.files:
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="numpy"))
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
            self._handles[file] = handle
            for name in handle.keys():
                if name in self._where:
                    raise CheckpointError(f"{self.dir}: tensor {name!r} is stored twice, in {self._where[name].name} "
                                          f"and {file.name}; keep one (transformers would read only one of them)")
                self._where[name] = file
            self._fp8.update(fp8_tensors(file))
        self.quantization = read_quant_config(self.dir)
        if self.quant_algos and not any(name.endswith(".weight_scale") for name in self._where):
            remove = "quantization_config from config.json" if self._from_config else "the file"
            raise CheckpointError(
                f"{self.dir}/{self._quant_file} says the layers are {' / '.join(self.quant_algos)}, but no layer has a "
                f"weight_scale: the weights are float. Remove {remove} to build the float checkpoint, or restore the "
                "quantized weights")
        self._modules: dict[str, str] = {}  # a layer read from a fused one → that one's module name
        check_sizes(self)  # the layer count first: a fused matrix of a layer the weights lack is that
        if self.config.architecture in FUSED_ARCHITECTURES:
            parts = fused_parts(self)
            self._rows, self._modules = parts.rows, parts.modules
            self._aliases.update(parts.shared)
            self._where.update({name: self._where[fused] for name, (fused, _, _) in parts.rows.items()})
            self._where.update({name: self._where[fused] for name, fused in parts.shared.items()})
        self._check_tied_head()
        if self.config.tie_word_embeddings and not self.quantization and EMBED not in self._where \
                and "lm_head.weight" in self._where:
            self._where[EMBED] = self._where["lm_head.weight"]  # a tied model saved as its head, as transformers ties
            self._aliases[EMBED] = "lm_head.weight"
        self.unused = check_tensors(self, {n for handle in self._handles.values() for n in handle.keys()})

    @property
    def float_dtype(self) -> str | None:
        """The model's own float type: the one `camshaft quantize` recorded of the checkpoint it quantized (its
        export is float32 whatever the model's), else the type the embedding is stored in; None where not float."""
        return (self.quantization or {}).get("camshaft", {}).get("source_dtype") or stored_float_dtype(self.dir)

    def _check_tied_head(self) -> None:
        """A tied head reads the embedding; a checkpoint that also stores a different lm_head.weight is refused
        (transformers would run that tensor, so the engine would disagree with it)."""
        embed, head = EMBED, "lm_head.weight"
        if not (self.config.tie_word_embeddings and head in self._where and embed in self._where):
            return
        if not np.array_equal(self._raw(head), self._raw(embed)):
            raise CheckpointError(
                f"{self.dir}/config.json ties the output head to the embedding (tie_word_embeddings: true), but the "
                f"checkpoint stores a different {head}, which transformers runs instead; set tie_word_embeddings to "
                "false in config.json to build the head it stores"
            )

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
        scale = self._raw(f"{prefix}.weight_scale").astype(np.float32)
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
        scale_2 = self._scalar(f"{prefix}.weight_scale_2") if f"{prefix}.weight_scale_2" in self._where else None
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

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape as its file's header gives it, nothing read."""
        if name in self._rows:
            fused, start, end = self._rows[name]
            return (end - start, *self.stored_shape(fused)[1:])
        name = self._aliases.get(name, name)
        if name in self._fp8:
            return tuple(self._fp8[name][0])
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def stored_name(self, name: str) -> str:
        """The stored tensor a name reads: a fused one's (Phi-3), an alias's, or its own."""
        return self._rows[name][0] if name in self._rows else self._aliases.get(name, name)

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def _raw(self, name: str) -> np.ndarray:
        file = self._where.get(name)
        if file is None:
            raise self.missing(name)
        stored, start, end = self._rows.get(name, (self._aliases.get(name, name), None, None))
        try:
            if stored in self._fp8:
                whole = read_fp8(file, *self._fp8[stored])
                return whole if start is None else whole[start:end]
            if start is not None:
                return self._handles[file].get_slice(stored)[start:end]
            return self._handles[file].get_tensor(stored)
        except (SafetensorError, OSError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{file.name}: tensor {name!r} could not be read: {exc}") from exc

    def missing(self, name: str) -> CheckpointError:
        return CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir}{self._hint(name)}")

    def _hint(self, name: str) -> str:
        """Where the index says a missing tensor is, or what a missing head may mean."""
        index = self.dir / "model.safetensors.index.json"
        shard = index_map(index).get(name) if index.is_file() else None
        if shard is not None:
            return f" (the index puts it in {shard}, which does not hold it)"
        if name == "lm_head.weight" and not self.config.tie_word_embeddings:
            return "; if the model's head is its embedding, set tie_word_embeddings to true in config.json"
        return ""

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> Iterator[str]:
        return iter(self._where)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as float32, after checking it exists and has the expected shape. A quantized layer's weight
        comes back dequantized, so every consumer can read any checkpoint."""
        if self.quantization is not None and name.endswith(".weight") and len(shape) == 2:
            quantized = self.quantized_linear(name[: -len(".weight")], *shape)
            if quantized is not None:
                return self._finite(name, quantized.dequantize())
        array = self._raw(name)
        if np.issubdtype(array.dtype, np.integer) or array.dtype == FP8:
            why = (f"it has no {HF_QUANT_CONFIG}" if self.quantization is None else
                   f"its {self._quant_file} quantizes no such layer, or the layer has no weight_scale")
            raise CheckpointError(
                f"{self._where[name].name}: tensor {name!r} holds {array.dtype} codes, but {self.dir} does not say "
                f"how to dequantize them ({why}); restore the checkpoint's quantization files or build from the "
                "float checkpoint"
            )
        if tuple(array.shape) != tuple(shape):
            raise CheckpointError(
                f"{self._where[name].name}: tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)} "
                "from config.json"
            )
        return self._finite(name, array.astype(np.float32, copy=False))

    def _finite(self, name: str, array: np.ndarray) -> np.ndarray:
        """`array`, refused if a value is NaN or infinite (a float64 sum: finite float32 ones cannot overflow it)."""
        if not np.isfinite(array.sum(dtype=np.float64)):
            raise CheckpointError(f"{self._where[name].name}: tensor {name!r} holds NaN or infinite values: an engine "
                                  "built from it could never give finite logits; restore the checkpoint's weights")
        return array

    def tokenizer_files(self) -> list[Path]:
        require_tokenizer(self.dir)
        return [self.dir / n for n in TOKENIZER_FILES if (self.dir / n).is_file()]

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

