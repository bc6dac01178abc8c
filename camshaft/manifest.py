"""The engine directory's manifest: the whole contract between build and run.

An engine directory holds `manifest.json`, the compiled artifact and `tokenizer/`. The manifest is written last,
so a directory without one (or with `complete` false) was never finished and never loads.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from camshaft.checks import check_positive_ints
from camshaft.engine_files import (
    MANIFEST_NAME,
    REPOSITORY_MARKER,
    TOKENIZER_DIR,
    check_unchanged,
    deployed_record,
    write_atomic,
)
from camshaft.engine_files import check_files as _check_files
from camshaft.errors import CamshaftError, EngineError
from camshaft.hf_config import sampling_defaults
from camshaft.io_signature import CACHE_NAMES, KVCacheLayout, SequenceGraph, TensorSpec, tensor_specs
from camshaft.model_config import ModelConfig
from camshaft.version import ENGINE_FORMAT_VERSION, READABLE_FORMAT_VERSIONS, __version__

TARGETS = ("onnxruntime", "tensorrt", "tensorrt-rtx")
TRT_MODULES = {"tensorrt-rtx": "tensorrt_rtx", "tensorrt": "tensorrt"}  # TensorRT target → its Python module


def _positive_ints(owner: object, names: tuple[str, ...]) -> None:
    check_positive_ints(owner, names, label=lambda name: f"{type(owner).__name__}.{name}")


@dataclass(frozen=True)
class BuildLimits:
    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    kv_block_size: int

    def __post_init__(self) -> None:
        _positive_ints(self, ("max_batch_size", "max_seq_len", "max_num_tokens", "kv_block_size"))

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.kv_block_size)


ENGINE_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    limits: BuildLimits
    dtype: str
    target: str
    artifact: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    kv_cache: KVCacheLayout
    quantization: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    graph_sha256: str = ""
    build_id: str = ""  # format 3: one per build, re-read after loading (engine_files.check_unchanged)
    fingerprints: dict[str, str] = field(default_factory=dict)  # format 3: each of `files` (engine_files.py)
    target_options: dict[str, Any] = field(default_factory=dict)
    sequence_graph: SequenceGraph | None = None  # absent: the Session runs the batch graph
    format_version: int = ENGINE_FORMAT_VERSION
    camshaft_version: str = __version__
    complete: bool = True

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target {self.target!r} is none of {', '.join(TARGETS)}")
        if self.kv_cache.block_size != self.limits.kv_block_size:
            raise ValueError(f"the KV cache's block size {self.kv_cache.block_size} differs from the limits' "
                             f"{self.limits.kv_block_size}")
        if self.format_version >= 3 and (not self.build_id or set(self.fingerprints) != set(self.files)):
            raise ValueError("a format-3 manifest has a build_id and a fingerprint for each of its files")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in self.files.values()) \
                or not isinstance(self.complete, bool):
            raise ValueError("files maps names to sizes in bytes, complete is true or false")
        outside = [name for name in self.files if not name or PurePosixPath(name).is_absolute()
                   or ".." in PurePosixPath(name).parts]
        if outside:
            raise ValueError(f"files names {outside[0]!r}, outside the engine directory: its files are named relative "
                             "to it")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is none of {', '.join(ENGINE_DTYPES)}")
        for name in ("quantization", "target_options", "tools", "fingerprints"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} is an object, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.quantization.get("lm_head") or {}, dict):
            raise ValueError("quantization.lm_head is an object")
        for name in ("build_id", "graph_sha256", "camshaft_version"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} is a string, got {getattr(self, name)!r:.40}")
        if self.kv_cache.dtype not in (self.dtype, "int8", "float8"):
            raise ValueError(f"kv_cache.dtype {self.kv_cache.dtype!r} is neither the engine's {self.dtype} nor int8 "
                             "or float8")
        for cache in (self.kv_cache, self.sequence_graph):  # the caches hold the model's K/V heads
            if cache is not None and (cache.num_kv_heads, cache.head_dim) != (self.model.num_kv_heads,
                                                                              self.model.head_dim):
                raise ValueError(f"{type(cache).__name__} holds {cache.num_kv_heads} KV heads of {cache.head_dim}, "
                                 f"the model {self.model.num_kv_heads} of {self.model.head_dim}")
        widths = [spec.shape[-1] for spec in self.outputs if spec.name == "logits" and spec.shape]
        if any(isinstance(w, int) and w != self.model.vocab_size for w in widths):
            raise ValueError(f"the logits output is {widths[0]} wide, the vocabulary {self.model.vocab_size}")
        for cache in (self.kv_cache, self.sequence_graph):
            if cache is not None and not all(len(getattr(cache, n)) == self.model.num_layers
                                             and all(isinstance(t, str) for t in getattr(cache, n))
                                             for n in CACHE_NAMES):
                raise ValueError(f"{type(cache).__name__} does not name one cache tensor a layer")
        if not all(isinstance(v, str) for v in self.tools.values()):
            raise ValueError("tools maps tool names to versions")
        artifacts = [self.artifact] + ([self.sequence_graph.artifact] if self.sequence_graph else [])
        unlisted = [a for a in artifacts if a not in self.files]
        if unlisted:
            raise ValueError(f"the artifact(s) {', '.join(unlisted)} are not among the engine's files")

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps({**data, "digest": manifest_digest(data)}, indent=2, sort_keys=False)

    def write(self, engine_dir: Path) -> None:
        write_atomic(Path(engine_dir) / MANIFEST_NAME, self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        data = dict(data)
        data["model"] = ModelConfig.from_dict(data["model"])
        data["limits"] = BuildLimits(**data["limits"])
        data["inputs"] = tensor_specs(data["inputs"])
        data["outputs"] = tensor_specs(data["outputs"])
        if data.get("sequence_graph") is not None:
            data["sequence_graph"] = SequenceGraph.from_dict(data["sequence_graph"])
        data["kv_cache"] = KVCacheLayout.from_dict(data["kv_cache"])
        return cls(**data)


def content_id(manifest: Manifest) -> str:
    """A build's id from what it holds: every field of its manifest but the id, its files' whole sha256 in
    `fingerprints`. Builds of the same checkpoint with the same options and tools share it."""
    fields = {k: v for k, v in asdict(manifest).items() if k != "build_id"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def manifest_digest(data: dict[str, Any]) -> str:
    """sha256 of a manifest's fields (all but the digest itself), as JSON with sorted keys."""
    fields = {k: v for k, v in data.items() if k != "digest"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(engine_dir: str | Path, *, check_files: bool = True, check_digest: bool = True) -> Manifest:
    """Read and validate an engine directory's manifest; every failure is an EngineError saying what to do.
    check_files False: the manifest alone, not the files it lists (their sizes and fingerprints); check_digest
    False: an edited manifest is read as it now is (to describe it, never to run it)."""
    engine_dir = Path(engine_dir)
    if engine_dir.exists() and not engine_dir.is_dir():
        raise EngineError(f"{engine_dir} is a file; an engine is the directory `camshaft build --output` wrote")
    if not engine_dir.is_dir():
        raise EngineError(f"engine directory {engine_dir} does not exist; build one with `camshaft build`")
    path = engine_dir / MANIFEST_NAME
    if not path.is_file() and (engine_dir / "config.json").is_file():
        raise EngineError(f"{engine_dir} is a Hugging Face checkpoint, not an engine; build one from it with "
                          f"`camshaft build --model {shlex.quote(str(engine_dir))} --output ENGINE_DIR` and pass that")
    if not path.is_file() and (engine_dir / REPOSITORY_MARKER).is_file():
        served = (deployed_record(engine_dir) or {}).get("engine_dir", "its engine")
        raise EngineError(f"{engine_dir} is a Triton model repository (camshaft deploy), not an engine; it serves "
                          f"{served}: pass that engine directory (or serve the repository: camshaft serve --repo)")
    if not path.is_file():
        raise EngineError(
            f"{engine_dir} has no {MANIFEST_NAME}: it is not an engine directory, or its build never finished. "
            "Rebuild it with `camshaft build`."
        )
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise EngineError(f"{path} disappeared while it was read (a rebuild replacing the engine?); load it "
                          "again") from exc
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep, a number too long
        raise EngineError(f"{path} is corrupt ({type(exc).__name__}: {str(exc)[:200]}); rebuild the engine with "
                          "`camshaft build`") from exc
    except OSError as exc:
        raise EngineError(f"{path} could not be read ({exc.strerror or exc}); make the engine directory readable by "
                          "this user") from exc
    if not isinstance(raw, dict):
        raise EngineError(f"{path} is corrupt (not a JSON object); rebuild the engine with `camshaft build`")
    version = raw.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise EngineError(f"{path} is corrupt (format_version {version!r} is not an integer); rebuild the engine")
    if version not in READABLE_FORMAT_VERSIONS:
        built_by = raw.get("camshaft_version")
        newer = built_by if isinstance(built_by, str) and built_by != __version__ else "the version that built it"
        fix = (f"upgrade camshaft to {newer} (one that reads engine format {version}), or rebuild the engine with "
               "this one" if version > ENGINE_FORMAT_VERSION else "rebuild the engine with this version's "
               "`camshaft build`")
        raise EngineError(
            f"{engine_dir} was built by camshaft {raw.get('camshaft_version', '?')} (engine format {version}); "
            f"this is camshaft {__version__} (engine format {ENGINE_FORMAT_VERSION}): {fix}."
        )
    if not raw.get("complete", False):
        raise EngineError(f"{engine_dir}: the build never finished; rebuild it with `camshaft build`")
    digest = raw.pop("digest", None)  # engines of formats 1-3 have none
    if check_digest and (digest is not None or version >= 4) and digest != manifest_digest(raw):
        raise EngineError(f"{path} was changed after the build (its digest no longer matches its contents): the "
                          "build writes the manifest to describe its graphs, and an edited one no longer does; undo "
                          "the edit, or rebuild the engine with `camshaft build` and the options wanted")
    if isinstance(raw.get("model"), dict) and "sampling_defaults" not in raw["model"]:  # built before it was kept
        raw["model"]["sampling_defaults"] = _tokenizer_sampling_defaults(engine_dir)
    try:
        manifest = Manifest.from_dict(raw)
    except (KeyError, TypeError, ValueError, AttributeError, CamshaftError) as exc:
        built_by = raw.get("camshaft_version")
        if isinstance(built_by, str) and built_by != __version__:  # an intact manifest another version wrote
            raise EngineError(f"{path} was written by camshaft {built_by}, and this camshaft {__version__} cannot "
                              f"read it ({type(exc).__name__}: {exc}); use camshaft {built_by}, or rebuild the "
                              "engine with this one") from exc
        raise EngineError(f"{path} is corrupt ({type(exc).__name__}: {exc}); rebuild the engine") from exc
    if not check_files:
        return manifest
    try:
        _check_files(engine_dir, manifest.files, manifest.fingerprints)
    except EngineError:
        check_unchanged(engine_dir, manifest.build_id)  # a rebuild swapping it meanwhile says so
        raise
    return manifest


def _tokenizer_sampling_defaults(engine_dir: Path) -> tuple[tuple[str, float], ...]:
    """An engine built before the manifest kept the model's recommended sampling: its copy of
    generation_config.json says it (nothing where a value is out of range, which builds now refuse)."""
    path = engine_dir / TOKENIZER_DIR / "generation_config.json"
    try:
        return sampling_defaults(json.loads(path.read_text()), str(path))
    except (OSError, ValueError, RecursionError, CamshaftError):
        return ()
