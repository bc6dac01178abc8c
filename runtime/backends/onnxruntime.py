"""ONNX Runtime backend: one session, KV caches bound as input and output so ScatterND writes in place."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from camshaft.engine_files import graph_bytes, hard_linked
from camshaft.errors import CapacityError, EngineError
from camshaft.graph_meta import check_build_id, check_graph_limits
from camshaft.io_signature import KVCacheLayout, SequenceGraph, TensorSpec
from camshaft.manifest import Manifest
from camshaft.runtime.backends.huge_pages import load_in_huge_pages, release_freed_memory
from camshaft.runtime.kv_cache import CGROUP, SELF_CGROUP, SMALLER_POOL, check_fits_host, host_available, own_cgroups

# KV cache dtype → numpy storage; float8 caches hold e4m3fn bit patterns in uint8 (the graph's cache type).
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "float8": np.uint8}
ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)",
             "int8": "tensor(int8)", "float8": "tensor(uint8)"}


def physical_cores(cgroup: Path = CGROUP, self_cgroup: Path | None = None) -> int:
    """The cores this process may keep busy: its CPU affinity, the machine's physical cores and a container's CPU
    quota (a `--cpus=2` container on a 16-core host gets 2 threads, not 16 fighting over 2 cores' time)."""
    available = len(os.sched_getaffinity(0))
    quota = cpu_quota_cores(cgroup, self_cgroup)
    if quota is not None:
        available = min(available, quota)
    try:
        import psutil

        return max(1, min(available, psutil.cpu_count(logical=False) or available))
    except ImportError:
        return max(1, available)


def cpu_quota_cores(cgroup: Path = CGROUP, self_cgroup: Path | None = None) -> int | None:
    """The tightest CPU quota of the cgroups binding this process (its own and their ancestors, as the memory
    limit's: v2 cpu.max, v1 cpu.cfs_quota_us), in whole cores rounded up; None without one."""
    quotas = [_quota_cores(d, v1) for d, v1 in own_cgroups("cpu", cgroup, self_cgroup or SELF_CGROUP)]
    return min((q for q in quotas if q is not None), default=None)


def _quota_cores(directory: Path, v1: bool) -> int | None:
    try:
        if v1:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        else:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if not (quota.isdigit() and period.isdigit()) or int(period) == 0:
        return None  # "max" (v2) or -1 (v1): no quota
    return max(1, -(-int(quota) // int(period)))


def check_compatible(manifest: Manifest) -> None:
    built = manifest.tools.get("onnxruntime", "")
    if not isinstance(built, str) or not built:
        raise EngineError("the manifest does not say which onnxruntime built this engine (tools.onnxruntime); "
                          "rebuild the engine with `camshaft build`")
    if built.split(".")[:2] != ort.__version__.split(".")[:2]:
        raise EngineError(
            f"this engine was built with onnxruntime {built}, but onnxruntime {ort.__version__} is installed; "
            f"rebuild the engine with `camshaft build` or install onnxruntime=={built}"
        )


def session_options(threads: int | None, spin_wait: bool) -> ort.SessionOptions:
    options = ort.SessionOptions()
    # The artifact is already optimised at the portable (extended) level; the layout- and hardware-specific
    # optimisations of ENABLE_ALL run at load (measured ~10% faster decode than BASIC on SmolLM2).
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads or physical_cores()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_wait else "0")
    return options


def load_session(path: Path, options: ort.SessionOptions, huge_pages: bool) -> tuple[ort.InferenceSession, int]:
    """An engine graph on the CPU provider, its weights on huge pages when asked (bytes that are); a corrupt file is
    an EngineError that says to rebuild."""
    try:
        return load_in_huge_pages(lambda: ort.InferenceSession(str(path), options,
                                                               providers=["CPUExecutionProvider"]), huge_pages)
    except Exception as exc:  # onnxruntime raises its own untyped errors for corrupt files
        if isinstance(exc, MemoryError) or any(s in str(exc) for s in ("bad_alloc", "Failed to allocate")):
            size = graph_bytes(path)
            raise CapacityError(f"{path} ({size / 2**20:.0f} MiB of graph and weights) does not fit this process's "
                                f"memory ({str(exc)[-120:]}); free memory, raise the process's limit, or build a "
                                "smaller (quantized) engine") from exc
        if "multiple hard links" in str(exc):
            raise hard_linked(path.with_name(path.name + ".data")) from exc
        raise EngineError(f"{path} could not be loaded ({exc}); rebuild the engine") from exc


def _allocate(shape: tuple[int, ...], dtype: type, count: int) -> np.ndarray:
    try:
        return np.zeros(shape, dtype=dtype)
    except MemoryError:
        size = count * math.prod(shape) * np.dtype(dtype).itemsize
        raise CapacityError(f"the KV cache pool ({shape[0]} blocks, {size / 2**30:.2f} GiB in all) does not fit this "
                            f"process's memory; {SMALLER_POOL}") from None


def graph_io(inputs: tuple[TensorSpec, ...], layout: KVCacheLayout | SequenceGraph) -> tuple[set[str], set[str]]:
    """The input and output names a graph has by its manifest: the step inputs and caches in, logits and caches out."""
    return ({spec.name for spec in inputs} | {*layout.key_inputs, *layout.value_inputs},
            {"logits", *layout.key_outputs, *layout.value_outputs})


def check_io_names(path: Path, inputs: set[str], outputs: set[str], wanted: tuple[set[str], set[str]]) -> None:
    for kind, names, want in (("input", inputs, wanted[0]), ("output", outputs, wanted[1])):
        if names != want:
            odd = sorted(names ^ want)
            raise EngineError(f"{path}'s {kind}s differ from its manifest's ({', '.join(odd[:4])}): the manifest was "
                              "edited or belongs to another build; rebuild the engine")


@dataclass(frozen=True)
class GraphIO:
    """A graph's inputs and outputs (name: (ONNX Runtime's type string, shape)) and its metadata, from a loaded
    session or from the graph file alone (inspect: no session, no weights)."""

    inputs: dict[str, tuple[str, tuple]]
    outputs: dict[str, tuple[str, tuple]]
    metadata: dict[str, str]

    @classmethod
    def of_session(cls, session: ort.InferenceSession) -> GraphIO:
        return cls({t.name: (t.type, tuple(t.shape)) for t in session.get_inputs()},
                   {t.name: (t.type, tuple(t.shape)) for t in session.get_outputs()},
                   dict(session.get_modelmeta().custom_metadata_map))

    @classmethod
    def of_file(cls, path: Path) -> GraphIO:
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # not ONNX at all (protobuf's DecodeError), unreadable: as load_session says it
            raise EngineError(f"{path} could not be read as ONNX ({type(exc).__name__}: {str(exc)[:200]}); rebuild "
                              "the engine") from exc
        constants = {t.name for t in model.graph.initializer}

        def described(values) -> dict[str, tuple[str, tuple]]:
            return {v.name: (ONNX_TYPES.get(v.type.tensor_type.elem_type, "other"),
                             tuple(d.dim_value if d.HasField("dim_value") else d.dim_param
                                   for d in v.type.tensor_type.shape.dim))
                    for v in values if v.name not in constants}

        return cls(described(model.graph.input), described(model.graph.output),
                   {p.key: p.value for p in model.metadata_props})


ONNX_TYPES = {onnx.TensorProto.FLOAT: "tensor(float)", onnx.TensorProto.FLOAT16: "tensor(float16)",
              onnx.TensorProto.BFLOAT16: "tensor(bfloat16)", onnx.TensorProto.INT8: "tensor(int8)",
              onnx.TensorProto.UINT8: "tensor(uint8)"}


def check_graph_io(engine_dir: Path, manifest: Manifest) -> None:
    """The graphs against the manifest as check_signature compares a loaded one, read from the graph files alone
    (inspect: no session, no weights)."""
    for layout in (manifest.kv_cache, manifest.sequence_graph):
        if layout is not None:
            check_signature(GraphIO.of_file(engine_dir / graph_contract(manifest, layout)[0]), engine_dir, manifest,
                            layout)


def graph_contract(manifest: Manifest, layout: KVCacheLayout | SequenceGraph
                   ) -> tuple[str, tuple[TensorSpec, ...], tuple[int | None, ...], str]:
    """What the manifest says of the graph holding `layout`'s caches: its file, its step inputs, its first cache's
    shape (None: not compared) and the caches' type (the sequence graph's are float32)."""
    if isinstance(layout, SequenceGraph):
        return layout.artifact, layout.inputs, (1, layout.num_kv_heads, None, layout.head_dim), "float32"
    return (manifest.artifact, manifest.inputs, (None, layout.block_size, layout.num_kv_heads * layout.head_dim),
            layout.dtype)


def check_signature(io: GraphIO, engine_dir: Path, manifest: Manifest, layout: KVCacheLayout | SequenceGraph) -> None:
    """The graph (a loaded session's or its file's, GraphIO) agrees with the manifest on what the runtime feeds and
    binds (graph_io: its step inputs and the caches of `layout`); and on what it sizes from it: the logits' width,
    the KV cache inputs (their type and first shape, graph_contract; symbolic dimensions are not compared), the build
    limits the graph was lowered for and the build it belongs to (graph_meta.py)."""
    artifact, inputs, cache_shape, cache_dtype = graph_contract(manifest, layout)
    path = engine_dir / artifact
    check_io_names(path, set(io.inputs), set(io.outputs), graph_io(inputs, layout))
    caches = [*layout.key_inputs, *layout.value_inputs]
    wrong = [name for name in caches if io.inputs[name][0] != ORT_TYPES[cache_dtype]]
    if wrong:
        raise EngineError(f"{path} has no {cache_dtype} cache input {wrong[0]} as its manifest says: the manifest "
                          "was edited or belongs to another build; rebuild the engine")
    shapes = {name: shape for name, (_, shape) in [*io.inputs.items(), *io.outputs.items()]}
    wanted = {"logits": (None, manifest.model.vocab_size), **{name: cache_shape for name in caches[:1]}}
    for name, dims in wanted.items():
        found = shapes.get(name)
        if found is not None and any(isinstance(f, int) and f and w is not None and f != w
                                     for f, w in zip(found, dims, strict=False)):
            raise EngineError(f"{path}'s {name} dimensions {tuple(found)} disagree with its manifest "
                              f"({tuple('?' if w is None else w for w in dims)}): the manifest was edited or belongs "
                              "to another build; rebuild the engine")
    check_graph_limits(io.metadata, manifest.limits, path)
    check_build_id(io.metadata, manifest.build_id, path)


class OnnxRuntimeBackend:
    def __init__(self, engine_dir: Path, manifest: Manifest, num_blocks: int | Callable[[int], int],
                 threads: int | None = None, spin_wait: bool = True, huge_pages: bool = True) -> None:
        """num_blocks: the KV pool's, or a sizing called with the host memory available once the weights are
        loaded."""
        check_compatible(manifest)
        self.session, self.huge_page_bytes = load_session(engine_dir / manifest.artifact,
                                                          session_options(threads, spin_wait), huge_pages)
        if callable(num_blocks):
            num_blocks = num_blocks(host_available())
            check_fits_host(manifest, num_blocks)
        kv = manifest.kv_cache
        shape = (num_blocks, kv.block_size, kv.num_kv_heads * kv.head_dim)
        check_signature(GraphIO.of_session(self.session), engine_dir, manifest, kv)
        self.num_blocks = num_blocks
        self.binding = self.session.io_binding()
        self.caches: list[np.ndarray] = []
        names = zip(kv.key_inputs + kv.value_inputs, kv.key_outputs + kv.value_outputs, strict=True)
        for input_name, output_name in names:
            cache = _allocate(shape, NUMPY_DTYPES[kv.dtype], len(kv.key_inputs) + len(kv.value_inputs))
            value = ort.OrtValue.ortvalue_from_numpy(cache)
            self.binding.bind_ortvalue_input(input_name, value)
            self.binding.bind_ortvalue_output(output_name, value)
            self.caches.append(cache)
        self.vocab_size = manifest.model.vocab_size
        # Logits land in a buffer of ours, so no per-step output list is built: it grows to the most rows a step has
        # had, up to a full batch (a step has no more rows than tokens); steps with more rows (drafts, prompt
        # log-probs) take ONNX Runtime's
        self._logits_rows = min(manifest.limits.max_batch_size, manifest.limits.max_num_tokens)
        self._logits = np.empty((0, self.vocab_size), dtype=np.float32)

    def close(self) -> None:
        self.binding = self.session = None
        self.caches = []
        release_freed_memory()

    def step(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        for name, array in feeds.items():
            self.binding.bind_cpu_input(name, array)
        rows = len(feeds["logits_index"])
        if len(self._logits) < rows <= self._logits_rows:
            self._logits = np.empty((rows, self.vocab_size), dtype=np.float32)
        if rows <= len(self._logits):
            out = self._logits[:rows]
            self.binding.bind_output("logits", "cpu", 0, np.float32, out.shape, out.ctypes.data)
            self.session.run_with_iobinding(self.binding)
            return out.copy()
        self.binding.bind_output("logits", "cpu")
        self.session.run_with_iobinding(self.binding)
        # Outputs come back in binding order: the caches first, then logits.
        return self.binding.get_outputs()[len(self.caches)].numpy()

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)
