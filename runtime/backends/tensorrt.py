"""TensorRT backend (targets "tensorrt-rtx" and "tensorrt"): one plan, one execution context, KV caches on the GPU.

THIS BACKEND HAS NEVER RUN ON A GPU. It was written and tested on machines without one: what is tested is that it
refuses cleanly where no GPU or driver exists (tests/test_tensorrt_backend.py); the test that executes a plan skips
there. Treat its first GPU run as its first test.

Same interface as backends/onnxruntime.py: `step(feeds) -> logits` (float32 [rows, vocab] on the host) for the feeds
runtime/batch.py builds; `kv_cache_bytes`. Per step: every feed is copied into a device buffer of its own (reserved
at load for the largest shape the plan's profile admits), its shape set on the context (`set_input_shape`), the plan
enqueued with `execute_async_v3` on one CUDA stream, the logits copied back and the stream synchronised.

KV caches: [num_blocks, block_size, kv_heads*head_dim] in the engine's float type, per layer and K/V. The parser
turns the graph's ScatterND into a Scatter layer that writes a whole new cache, so each cache has two buffers, bound
as input and output, which swap after every step: a step copies every cache. (TensorRT's in-place KVCacheUpdate takes
a dense [B, N, S_max, H] cache, not this paged one.) A cache whose output a plan aliases to its input
(`get_aliased_input_tensor`) would be one buffer bound as both; no plan of camshaft's graphs does.
The first GPU run must compare logits against the onnxruntime engine (the skipped test does).

The GPU is probed with cuda-python's `cudaGetDeviceCount()` before anything of TensorRT is touched: creating a
TensorRT runtime on a machine without a driver can crash the process instead of raising.
"""

from __future__ import annotations

import importlib
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from camshaft.cuda_gpu import probe_gpu0, rtx_archs
from camshaft.errors import EngineError, needs_extra
from camshaft.manifest import TRT_MODULES, Manifest
from camshaft.runtime.backends.cuda_buffers import DeviceBuffer, check_cuda, numpy_dtype
from camshaft.runtime.kv_cache import plan_blocks
from camshaft.trt_logger import capturing_logger, quoted

log = logging.getLogger(__name__)


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
    gpu = probe_gpu0(cudart)
    if gpu.old_driver:
        raise EngineError(f"this engine targets {product} {arch}, and {gpu.old_driver}.")
    if gpu.arch is None:
        raise EngineError(
            f"this engine targets {product} {arch} and needs an NVIDIA GPU with a driver; none found ({gpu.reason}), "
            "so it cannot run here. Run it on such a GPU, or build an engine for the onnxruntime target."
        )
    return cudart, gpu.arch


def check_compatible(manifest: Manifest) -> tuple[Any, int, Any]:
    """(cuda runtime, GPU 0's compute capability, the TensorRT module) when this machine can run the engine: a GPU
    of the architecture it was built for and the TensorRT release that built it; else an EngineError saying what to
    do."""
    product, options = manifest.target, manifest.target_options
    arch = str(options.get("gpu_arch", "(unknown architecture)"))
    cudart, local = probe_gpu(product, arch)  # the GPU, through cuda-python only
    trt = TensorRTBackend._import(product)
    if arch.startswith("sm") and arch[2:].isdigit() and int(arch[2:]) != local:
        if product != "tensorrt-rtx":
            fix = "rebuild it on this GPU (--target tensorrt builds for the GPU it runs on)"
        elif local in rtx_archs(trt):
            fix = f"rebuild it with --gpu-arch sm{local}"
        else:
            fix = f"{product} {trt.__version__} cannot build for it: rebuild with --target tensorrt on this GPU"
        raise EngineError(f"this engine was built for {arch} but GPU 0 is sm{local}; {fix}")
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
        self.cudart, local, trt = check_compatible(manifest)
        try:
            self._load(engine_dir, manifest, num_blocks, trt, local)
        except BaseException as failure:
            try:
                self.close()  # what the failed load made on the GPU: the plan, its context, the stream, the buffers
            except Exception as cleanup:  # a CUDA context already broken: the load's own error is the one to see
                failure.add_note(f"(freeing what the load had made failed too: {cleanup})")
            raise

    def _load(self, engine_dir: Path, manifest: Manifest, num_blocks: int | Callable[[int], int], trt: Any,
              local: int) -> None:
        cudart, product = self.cudart, manifest.target
        # 3. The plan.
        plan_path = engine_dir / manifest.artifact
        try:
            plan = plan_path.read_bytes()
        except OSError as exc:
            raise EngineError(f"{plan_path} could not be read ({exc}); rebuild the engine") from exc
        self.messages: deque[str] = deque(maxlen=10)  # TensorRT's latest errors and warnings, for our errors
        self.logger = capturing_logger(trt, self.messages, log.error)  # errors are logged as they come, too
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise EngineError(f"{product} {trt.__version__} could not load {plan_path} on sm{local}: a plan built by "
                              f"this release for this GPU loads unless the file is damaged or the CUDA driver is too "
                              f"old for {product}; update the driver or rebuild the engine. {product} said:\n"
                              + quoted(self.messages))
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise EngineError(f"{product} could not create an execution context for {plan_path} (GPU memory?); "
                              f"{product} said:\n" + quoted(self.messages))
        self.stream = check_cuda(cudart, cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._dtypes = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            self._dtypes[name] = numpy_dtype(trt, self.engine.get_tensor_dtype(name))
        self.vocab_size = manifest.model.vocab_size
        self._buffers: dict[str, DeviceBuffer] = {}
        self._reserve_step_buffers(manifest)
        if callable(num_blocks):  # a fraction of the GPU memory the plan, its context and the step buffers leave
            free, _total = check_cuda(cudart, cudart.cudaMemGetInfo(), "cudaMemGetInfo")
            num_blocks = num_blocks(int(free))
        most = plan_blocks(manifest)
        if most is not None and num_blocks > most:
            raise EngineError(
                f"a KV pool of {num_blocks} blocks exceeds the {most} blocks the plan was built for; "
                "lower max_sequences or kv_cache_memory, or rebuild with a larger --max-batch-size"
            )
        # 4. KV caches. An output the plan aliases to its input (TensorRT's KVCacheUpdate) is bound in place; the
        # graph's ScatterND writes a whole new cache, so otherwise each cache gets a second buffer, the output, and
        # the two swap after every step.
        kv = manifest.kv_cache
        self.num_blocks = num_blocks
        shape = (num_blocks, kv.block_size, kv.num_kv_heads * kv.head_dim)
        self.caches: list[DeviceBuffer] = []
        self._spares: list[DeviceBuffer | None] = []
        self._cache_names = list(zip(kv.key_inputs + kv.value_inputs, kv.key_outputs + kv.value_outputs, strict=True))
        aliased = getattr(self.engine, "get_aliased_input_tensor", lambda name: None)
        for input_name, output_name in self._cache_names:
            nbytes = int(np.prod(shape)) * self._dtypes[input_name].itemsize
            cache = DeviceBuffer(cudart, nbytes)
            check_cuda(cudart, cudart.cudaMemsetAsync(cache.ptr, 0, nbytes, self.stream), "cudaMemsetAsync")
            self.caches.append(cache)
            self._spares.append(None if aliased(output_name) == input_name else DeviceBuffer(cudart, nbytes))
            self._shape(input_name, shape)
        check_cuda(cudart, cudart.cudaStreamSynchronize(self.stream), "stream synchronise")
        self._bind_caches()

    def _reserve_step_buffers(self, manifest: Manifest) -> None:
        """Every step input's device buffer and the logits' at the largest shape the plan's profile admits, before
        the KV pool is sized from the memory left: no step allocates (with a pool of nearly all of it, a long step
        would otherwise fail mid-serving)."""
        largest = {name: int(hi) for name, (_, _, hi) in manifest.target_options.get("profile", {}).items()}
        if "N" not in largest:
            raise EngineError("the manifest records no optimisation profile for this plan; rebuild the engine")
        for spec in manifest.inputs:
            if spec.name in self._dtypes:  # TensorRT drops graph inputs nothing consumes
                count = int(np.prod([largest[d] if isinstance(d, str) else d for d in spec.shape]))
                self._bind(spec.name, DeviceBuffer(self.cudart, count * self._dtypes[spec.name].itemsize))
        self._bind("logits", DeviceBuffer(self.cudart, largest["N"] * self.vocab_size * 4))

    def _bind(self, name: str, buffer: DeviceBuffer) -> None:
        if not self.context.set_tensor_address(name, buffer.ptr):
            buffer.free()
            raise EngineError(f"TensorRT refused the device address of tensor {name}; rebuild the engine")
        self._buffers[name] = buffer

    def _bind_caches(self) -> None:
        for (input_name, output_name), cache, spare in zip(self._cache_names, self.caches, self._spares, strict=True):
            for name, ptr in ((input_name, cache.ptr), (output_name, (spare or cache).ptr)):
                if not self.context.set_tensor_address(name, ptr):
                    raise EngineError(f"TensorRT refused the device address of KV cache {name}; rebuild the engine")

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
        self._shape(name, array.shape)  # within the profile: its buffer holds it (_reserve_step_buffers)
        if array.nbytes:
            self._copy(self._buffers[name].ptr, array.ctypes.data, array.nbytes, "HostToDevice", f"upload of {name}")
        # The host array must outlive the asynchronous copy: keep it until the step synchronises.
        self._uploaded.append(array)

    def _copy(self, dst: int, src: int, nbytes: int, kind: str, what: str) -> None:
        kind = getattr(self.cudart.cudaMemcpyKind, f"cudaMemcpy{kind}")
        check_cuda(self.cudart, self.cudart.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream), what)

    def step(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        self._uploaded: list[np.ndarray] = []
        rows = len(feeds["logits_index"])
        if rows == 0:  # the profile's smallest logits batch is one row: compute one, return none
            feeds = {**feeds, "logits_index": np.zeros(1, dtype=np.int64)}
        for name, array in feeds.items():
            if name in self._dtypes:  # TensorRT drops graph inputs nothing consumes
                self._upload(name, array)
        n = max(rows, 1)
        if not self.context.execute_async_v3(int(self.stream)):
            raise EngineError("TensorRT could not enqueue the step; it said:\n" + quoted(self.messages))
        out = np.empty((n, self.vocab_size), dtype=np.float32)
        self._copy(out.ctypes.data, self._buffers["logits"].ptr, out.nbytes, "DeviceToHost", "logits download")
        check_cuda(self.cudart, self.cudart.cudaStreamSynchronize(self.stream), "stream synchronise")
        self._uploaded = []
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
            check_cuda(self.cudart, self.cudart.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass
