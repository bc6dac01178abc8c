"""Reading Hugging Face checkpoint directories: config, (sharded) safetensors, tokenizer files."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from camshaft.builder.checkpoint_quant import QuantizedView
from camshaft.builder.checkpoint_sizes import check_sizes, fused_parts
from camshaft.builder.checkpoint_tensors import check_tensors
from camshaft.builder.quant_config import read_quant_config
from camshaft.builder.quantized import (  # noqa: F401  (QuantizedLinear and FP8 are part of this module's API)
    FP8,
    MIXED,
    READABLE_QUANT_ALGOS,
    QuantizedLinear,
    fp8_tensors,
    read_fp8,
)
from camshaft.errors import CheckpointError
from camshaft.hf_config import FUSED_ARCHITECTURES
from camshaft.model_config import HF_QUANT_CONFIG, TOKENIZER_FILES, ModelConfig, missing_checkpoint, require_tokenizer
from camshaft.weight_files import EMBED, index_map, stored_float_dtype, unreadable, weight_files


class Checkpoint(QuantizedView):
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
                raise unreadable(file, exc) from exc
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
        if "lm_head.weight_scale" in self._where:
            raise CheckpointError(
                f"{self.dir}/config.json ties the output head to the embedding (tie_word_embeddings: true), but the "
                "checkpoint stores lm_head quantized (lm_head.weight_scale): the quantizer rounded the tied head and "
                "kept the embedding float. Set tie_word_embeddings to false in config.json to build that quantized "
                "head beside the float embedding (what the quantizer's fake-quant model computes), or quantize again "
                "with lm_head excluded (ModelOpt's default)"
            )
        if not np.array_equal(self._raw(head), self._raw(embed)):
            raise CheckpointError(
                f"{self.dir}/config.json ties the output head to the embedding (tie_word_embeddings: true), but the "
                f"checkpoint stores a different {head}, which transformers runs instead; set tie_word_embeddings to "
                "false in config.json to build the head it stores"
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
            raise self._not_finite(name)
        return array

    def _not_finite(self, name: str) -> CheckpointError:
        return CheckpointError(f"{self._where[name].name}: tensor {name!r} holds NaN or infinite values: an engine "
                               "built from it could never give finite logits; restore the checkpoint's weights")

    def tokenizer_files(self) -> list[Path]:
        require_tokenizer(self.dir)
        return [self.dir / n for n in TOKENIZER_FILES if (self.dir / n).is_file()]

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

