"""TensorRT backend (targets "tensorrt-rtx" and "tensorrt"): one plan, one execution context, KV caches on the GPU.

THIS BACKEND HAS NEVER RUN ON A GPU. It was written and tested on machines without one: what is tested is that it
refuses cleanly where no GPU or driver exists (tests/test_tensorrt_backend.py); the test that executes a plan skips
there. Treat its first GPU run as its first test.

Same interface as backends/onnxruntime.py: `step(feeds) -> logits` (float32 [rows, vocab] on the host) for the feeds
runtime/batch.py builds; `kv_cache_bytes`. Per step: every feed is copied into a device buffer of its own (grown
as needed), its shape set on the context (`set_input_shape`), the plan enqueued with `execute_async_v3` on one CUDA
stream, the logits copied back and the stream synchronised.

KV caches: [num_blocks, block_size, kv_heads*head_dim] in the engine's float type, per layer and K/V. A cache whose
output the plan aliases to its input (`get_aliased_input_tensor`: TensorRT's KVCacheUpdate) is one device buffer
bound as both; otherwise the graph's ScatterND writes a whole new cache, so each cache has two buffers, bound as
input and output, which swap after every step (a step copies every cache: what a fused in-place update would save).
The first GPU run must compare logits against the onnxruntime engine (the skipped test does).

The GPU is probed with cuda-python's `cudaGetDeviceCount()` before anything of TensorRT is touched: creating a
TensorRT runtime on a machine without a driver can crash the process instead of raising.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from camshaft.errors import EngineError, needs_extra
from camshaft.manifest import TRT_MODULES, Manifest
from camshaft.runtime.kv_cache import plan_blocks


def _cudart(product: str, arch: str) -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise EngineError(needs_extra(f"this engine (it targets {product} {arch}; cuda-python reaches the GPU)",
                                      product)) from exc
    return cudart


def probe_gpu(product: str, arch: str) -> tuple[Any, int]:
    """cuda-python's runtime module and the compute capability of GPU 0 (89 for SM 8.9), or an EngineError that
    says why this engine cannot run here. Touches nothing of TensorRT."""
    cudart = _cudart(product, arch)
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or not count:
        reason = getattr(err, "name", str(err)) if err != cudart.cudaError_t.cudaSuccess else "no CUDA device"
        raise EngineError(
            f"this engine targets {product} {arch} and needs an NVIDIA GPU with a driver; none found ({reason}), "
            "so it cannot run here. Run it on such a GPU, or build an engine for the onnxruntime target."
        )
    attr = cudart.cudaDeviceAttr
    _, major = cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, 0)
    _, minor = cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, 0)
    return cudart, major * 10 + minor


def _check(cudart: Any, result: tuple, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise EngineError(f"CUDA {what} failed: {getattr(err, 'name', err)}")
    return rest[0] if len(rest) == 1 else rest


class _DeviceBuffer:
    def __init__(self, cudart: Any, nbytes: int) -> None:
        self.cudart = cudart
        self.nbytes = max(int(nbytes), 1)
        self.ptr = int(_check(cudart, cudart.cudaMalloc(self.nbytes), f"cudaMalloc({self.nbytes})"))

    def free(self) -> None:
        if self.ptr:
            self.cudart.cudaFree(self.ptr)
            self.ptr = 0


def _numpy_dtype(trt, dtype) -> np.dtype:
    """numpy's view of a TensorRT tensor type; trt.nptype has no bfloat16 (ml_dtypes provides it)."""
    bf16 = getattr(getattr(trt, "DataType", None), "BF16", None)
    if bf16 is not None and dtype == bf16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(trt.nptype(dtype))


def check_compatible(manifest: Manifest) -> tuple[Any, int, Any]:
    """(cuda runtime, GPU 0's compute capability, the TensorRT module) when this machine can run the engine: a GPU
    of the architecture it was built for and the TensorRT release that built it; else an EngineError saying what to
    do."""
    product, options = manifest.target, manifest.target_options
    arch = str(options.get("gpu_arch", "(unknown architecture)"))
    cudart, local = probe_gpu(product, arch)  # the GPU, through cuda-python only
    if arch.startswith("sm") and arch[2:].isdigit() and int(arch[2:]) != local:
        raise EngineError(
            f"this engine was built for {arch} but GPU 0 is sm{local}; rebuild it with --gpu-arch sm{local} "
            f"({product} does not target every architecture: `camshaft build` refuses those it does not, and "
            "--target tensorrt builds for datacenter GPUs)"
        )
    trt = TensorRTBackend._import(product)
    built = str(options.get("version", manifest.tools.get(product, "")))
    if built != trt.__version__:  # a plan runs only on the release that built it
        raise EngineError(
            f"this engine was built with {product} {built}, but {trt.__version__} is installed; rebuild the engine "
            f"or install {product}=={built}"
        )
    return cudart, local, trt


class TensorRTBackend:
    """Never run on a GPU (see the module docstring)."""

    def __init__(self, engine_dir: Path, manifest: Manifest, num_blocks: int | Callable[[int], int],
                 threads: int | None = None, spin_wait: bool = True, huge_pages: bool = True) -> None:
        """num_blocks: the KV pool's, or what sizes it once the plan and its context are on the GPU (a fraction of
        the memory then free)."""
        del threads, spin_wait, huge_pages  # CPU options of the onnxruntime backend; nothing to set here
        self.huge_page_bytes = 0
        product = manifest.target
        cudart, local, trt = check_compatible(manifest)
        self.cudart = cudart
        # 3. The plan.
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        plan_path = engine_dir / manifest.artifact
        try:
            plan = plan_path.read_bytes()
        except OSError as exc:
            raise EngineError(f"{plan_path} could not be read ({exc}); rebuild the engine") from exc
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise EngineError(
                f"{product} {trt.__version__} could not load {plan_path} on sm{local}; rebuild the engine")
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise EngineError(f"{product} could not create an execution context for {plan_path} (GPU memory?)")
        self.stream = _check(cudart, cudart.cudaStreamCreate(), "cudaStreamCreate")
        if callable(num_blocks):  # a fraction of the GPU memory the plan and its context leave
            free, _total = _check(cudart, cudart.cudaMemGetInfo(), "cudaMemGetInfo")
            num_blocks = num_blocks(int(free))
        most = plan_blocks(manifest)
        if most is not None and num_blocks > most:
            raise EngineError(
                f"a KV pool of {num_blocks} blocks exceeds the {most} blocks the plan was built for; "
                "lower max_sequences or kv_cache_memory, or rebuild with a larger --max-batch-size"
            )
        self._dtypes = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            self._dtypes[name] = _numpy_dtype(trt, self.engine.get_tensor_dtype(name))
        # 4. KV caches. An output the plan aliases to its input (TensorRT's KVCacheUpdate) is bound in place; the
        # graph's ScatterND writes a whole new cache, so otherwise each cache gets a second buffer, the output, and
        # the two swap after every step.
        kv = manifest.kv_cache
        self.num_blocks = num_blocks
        shape = (num_blocks, kv.block_size, kv.num_kv_heads * kv.head_dim)
        self.caches: list[_DeviceBuffer] = []
        self._spares: list[_DeviceBuffer | None] = []
        self._buffers: dict[str, _DeviceBuffer] = {}
        self._cache_names = list(zip(kv.key_inputs + kv.value_inputs, kv.key_outputs + kv.value_outputs, strict=True))
        aliased = getattr(self.engine, "get_aliased_input_tensor", lambda name: None)
        for input_name, output_name in self._cache_names:
            nbytes = int(np.prod(shape)) * self._dtypes[input_name].itemsize
            cache = _DeviceBuffer(cudart, nbytes)
            _check(cudart, cudart.cudaMemset(cache.ptr, 0, nbytes), "cudaMemset")
            self.caches.append(cache)
            self._spares.append(None if aliased(output_name) == input_name else _DeviceBuffer(cudart, nbytes))
            self._shape(input_name, shape)
        self._bind_caches()
        self.vocab_size = manifest.model.vocab_size

    def _bind_caches(self) -> None:
        for (input_name, output_name), cache, spare in zip(self._cache_names, self.caches, self._spares, strict=True):
            self.context.set_tensor_address(input_name, cache.ptr)
            self.context.set_tensor_address(output_name, (spare or cache).ptr)

    def _swap_caches(self) -> None:
        """After a step: the outputs hold the updated caches, which the next step reads."""
        if any(spare is not None for spare in self._spares):
            pairs = list(zip(self.caches, self._spares, strict=True))
            self.caches = [cache if spare is None else spare for cache, spare in pairs]
            self._spares = [None if spare is None else cache for cache, spare in pairs]
            self._bind_caches()

    @staticmethod
    def _import(product: str) -> Any:
        module = TRT_MODULES.get(product)
        if module is None:
            raise EngineError(f"unknown TensorRT product {product!r} in the manifest")
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            raise EngineError(needs_extra(f"this engine (the {module} Python package: {exc})", product)) from exc

    def _shape(self, name: str, shape: tuple[int, ...]) -> None:
        if not self.context.set_input_shape(name, tuple(int(d) for d in shape)):
            raise EngineError(f"input {name} of shape {tuple(shape)} is outside the plan's optimisation profile")

    def _upload(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=self._dtypes[name])
        buffer = self._buffers.get(name)
        if buffer is None or buffer.nbytes < array.nbytes:
            buffer = self._grow(name, max(array.nbytes * 2, 256))
        self._shape(name, array.shape)
        if array.nbytes:
            kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
            _check(self.cudart, self.cudart.cudaMemcpyAsync(buffer.ptr, array.ctypes.data, array.nbytes, kind,
                                                            self.stream), f"upload of {name}")
        # The host array must outlive the asynchronous copy: keep it until the step synchronises.
        self._pinned.append(array)

    def _grow(self, name: str, nbytes: int) -> _DeviceBuffer:
        """A larger device buffer for tensor `name`, bound in place of its old one; the new one is allocated first, so
        a failed allocation leaves the old buffer bound and usable."""
        grown = _DeviceBuffer(self.cudart, nbytes)
        old = self._buffers.get(name)
        self._buffers[name] = grown
        self.context.set_tensor_address(name, grown.ptr)
        if old is not None:
            old.free()
        return grown

    def step(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        self._pinned: list[np.ndarray] = []
        rows = len(feeds["logits_index"])
        if rows == 0:  # the profile's smallest logits batch is one row: compute one, return none
            feeds = {**feeds, "logits_index": np.zeros(1, dtype=np.int64)}
        for name, array in feeds.items():
            if name in self._dtypes:  # TensorRT drops graph inputs nothing consumes
                self._upload(name, array)
        n = max(rows, 1)
        logits = self._buffers.get("logits")
        needed = n * self.vocab_size * 4
        if logits is None or logits.nbytes < needed:
            logits = self._grow("logits", needed * 2)
        if not self.context.execute_async_v3(int(self.stream)):
            raise EngineError("TensorRT could not enqueue the step")
        out = np.empty((n, self.vocab_size), dtype=np.float32)
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _check(self.cudart, self.cudart.cudaMemcpyAsync(out.ctypes.data, logits.ptr, out.nbytes, kind, self.stream),
               "logits download")
        _check(self.cudart, self.cudart.cudaStreamSynchronize(self.stream), "stream synchronise")
        self._pinned = []
        self._swap_caches()
        return out[:rows]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.nbytes for c in [*self.caches, *self._spares] if c is not None)

    def close(self) -> None:
        """Free the buffers once the stream is idle, then the context, the plan and the runtime (the weights' GPU
        memory), then the stream."""
        stream, self.stream = getattr(self, "stream", None), None
        if stream is not None:
            self.cudart.cudaStreamSynchronize(stream)  # nothing may still read or write a buffer freed below
        for buffer in [*getattr(self, "caches", []), *(s for s in getattr(self, "_spares", []) if s is not None),
                       *getattr(self, "_buffers", {}).values()]:
            buffer.free()
        self.caches, self._spares, self._buffers = [], [], {}
        self.context = self.engine = self.runtime = None  # in this order: a context before its plan
        if stream is not None:
            _check(self.cudart, self.cudart.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass
