"""Reading Hugging Face checkpoint directories: config, (sharded) safetensors, tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy so safetensors can return them)
import numpy as np
from safetensors import SafetensorError, safe_open

from camshaft.errors import CheckpointError
from camshaft.model_config import ModelConfig

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)


class Checkpoint:
    """Tensors by name across one or many safetensors files, each checked against its expected shape."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self.config = ModelConfig.from_hf_dir(self.dir)
        self.files = self._weight_files()
        self._stack = ExitStack()
        self._where: dict[str, Path] = {}
        self._handles = {}
        for file in self.files:
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="numpy"))
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
            self._handles[file] = handle
            for name in handle.keys():
                self._where[name] = file

    def _weight_files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index} is malformed: {exc}") from exc
            files = sorted({self.dir / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
            return files
        files = sorted(self.dir.glob("*.safetensors"))
        if files:
            return files
        pickles = sorted(p.name for p in self.dir.glob("*.bin")) + sorted(p.name for p in self.dir.glob("*.pt"))
        if pickles:
            raise CheckpointError(
                f"{self.dir} holds only pickle weights ({', '.join(pickles[:3])}); camshaft never unpickles weights "
                "(unpickling can run arbitrary code). Convert them to safetensors first, e.g. "
                "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)`."
            )
        raise CheckpointError(f"{self.dir} has no *.safetensors weights")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> Iterator[str]:
        return iter(self._where)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as float32, after checking it exists and has the expected shape."""
        file = self._where.get(name)
        if file is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        try:
            array = self._handles[file].get_tensor(name)
        except (SafetensorError, OSError, TypeError) as exc:
            raise CheckpointError(f"{file.name}: tensor {name!r} could not be read: {exc}") from exc
        if tuple(array.shape) != tuple(shape):
            raise CheckpointError(
                f"{file.name}: tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)} "
                "from config.json"
            )
        return array.astype(np.float32, copy=False)

    def tokenizer_files(self) -> list[Path]:
        files = [self.dir / n for n in TOKENIZER_FILES if (self.dir / n).is_file()]
        if not any(f.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in files):
            raise CheckpointError(f"{self.dir} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
        return files

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
