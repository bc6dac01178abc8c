"""Where a Hugging Face checkpoint's weights are: its safetensors files (never pickles), and their tensor names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from camshaft.errors import CheckpointError


def lfs_pointer(path: Path) -> bool:
    """A git-lfs pointer file in place of the file (cloned without git-lfs)."""
    try:
        with open(path, "rb") as f:
            return f.read(40).startswith(b"version https://git-lfs")
    except OSError:
        return False


def lfs_pointer_error(file: Path) -> CheckpointError:
    return CheckpointError(f"{file} is a git-lfs pointer, not the file: fetch it (git lfs pull) and try again")


def unreadable(file: Path, exc: Exception) -> CheckpointError:
    return lfs_pointer_error(file) if lfs_pointer(file) else \
        CheckpointError(f"{file} is not a readable safetensors file: {exc}")


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names, else every *.safetensors file (camshaft
    quantize's side file of KV scales beside model.safetensors)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = index_map(index)
        files = sorted({model_dir / f for f in weight_map.values()})
        single = model_dir / "model.safetensors"
        if single.is_file() and single not in files:  # transformers would read model.safetensors, not the index
            shards = ", ".join(f.name for f in files[:3]) + (", …" if len(files) > 3 else "")
            raise CheckpointError(
                f"{model_dir} holds model.safetensors and an index of other shards ({shards}); transformers reads "
                "model.safetensors and ignores the index. Remove the one that is stale")
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    if pickles:
        raise CheckpointError(
            f"{model_dir} holds only pickle weights ({', '.join(pickles[:3])}); camshaft never unpickles weights "
            "(unpickling can run arbitrary code). Convert them to safetensors first, e.g. "
            "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)`."
        )
    raise CheckpointError(f"{model_dir} has no *.safetensors weights")


def index_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map: tensor name -> a shard file in the index's directory."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, RecursionError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is malformed: {exc!r:.200}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: weight_map must be an object of tensor names to shard files, got "
                              f"{weight_map!r:.80}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise CheckpointError(f"{index}: tensor {name!r} maps to {shard!r}; each shard is a file name in the "
                                  "checkpoint directory")
    return weight_map


def headers(model_dir: Path) -> Iterator[tuple[Path, str, str, list[int]]]:
    """(file, tensor name, safetensors dtype, shape) of every tensor of the checkpoint, from the safetensors headers
    without loading a tensor."""
    from safetensors import SafetensorError, safe_open

    for file in weight_files(model_dir):
        try:
            with safe_open(str(file), framework="numpy") as handle:
                for key in handle.keys():
                    tensor = handle.get_slice(key)
                    yield file, key, tensor.get_dtype(), tensor.get_shape()
        except (SafetensorError, OSError) as exc:
            raise unreadable(file, exc) from exc


def matrix_names(model_dir: Path) -> list[str]:
    """Names (without `.weight`) of the checkpoint's 2-D weights other than embeddings: its linear layers."""
    return [name[: -len(".weight")] for _, name, _, shape in headers(model_dir)
            if name.endswith(".weight") and "embed" not in name and len(shape) == 2]


def refuse_stored_codes(model_dir: Path, error: type[Exception], advice: str) -> None:
    """Refuse, before loading anything, a checkpoint without hf_quant_config.json whose weights are integer or fp8
    codes: transformers reads them as floats, the raw codes, without a word."""
    found = next(((file, name, dtype) for file, name, dtype, _ in headers(model_dir)
                  if name.endswith((".weight", ".qweight")) and dtype.startswith(("I", "U", "F8"))), None)
    if found:
        file, name, dtype = found
        dtype = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}.get(dtype, dtype.replace("I", "int")
                                                                             .replace("U", "uint"))
        raise error(f"{file.name}: tensor {name!r} holds {dtype} codes, but {model_dir} does not say how to dequantize "
                    f"them (it has no hf_quant_config.json); {advice}")


SAFETENSORS_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
EMBED = "model.embed_tokens.weight"


def stored_float_dtype(model_dir: Path) -> str | None:
    """The float type a checkpoint stores its embedding in (its own precision; a tied model saved as its head: the
    head's), from the safetensors headers; None where that is not float or not there."""
    found = {name: dtype for _, name, dtype, _ in headers(model_dir) if name in (EMBED, "lm_head.weight")}
    stored = found.get(EMBED, found.get("lm_head.weight"))
    return SAFETENSORS_FLOATS.get(stored) if stored else None
