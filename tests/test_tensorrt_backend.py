"""The TensorRT backend (runtime/backends/tensorrt.py), which has never run on a GPU.

Here (no GPU, no driver): loading a real TensorRT-RTX engine fails with a clear EngineError before anything of
TensorRT is touched. The backend's plumbing (device buffers, shapes, tensor addresses, KV caches bound as input and
output, logits rows) is exercised against stand-ins: a cuda-python runtime whose "device" memory is host memory, and
a TensorRT module whose execution context runs the engine's own float16 source graph (graph.onnx, beside the plan) in
ONNX Runtime, reading and writing the bound addresses. That checks the backend's side of the contract, not TensorRT.
The test that runs a plan on a real GPU skips where none is present.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from camshaft.builder.build import GRAPH_NAME, build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import EngineError, RequestError
from camshaft.runtime.backends import tensorrt as backend
from camshaft.runtime.batch import Chunk
from camshaft.runtime.engine import Engine

from tiny_models import make_tiny_model

needs_rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                               reason="tensorrt_rtx is not installed (pip install 'camshaft[tensorrt-rtx]')")


def _gpu_arch() -> int | None:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or not count:
        return None
    return backend.probe_gpu("tensorrt-rtx", "?")[1]


GPU_ARCH = _gpu_arch()
BLOCK = 4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A tiny model built twice: for tensorrt-rtx (sm89, or this machine's GPU) and for onnxruntime (reference)."""
    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.skip("tensorrt_rtx is not installed")
    root = tmp_path_factory.mktemp("trt-backend")
    model = make_tiny_model("qwen3-qknorm", root / "hf")
    limits = dict(max_seq_len=64, max_batch_size=4, max_num_tokens=32, kv_block_size=BLOCK)
    arch = f"sm{GPU_ARCH}" if GPU_ARCH is not None else "sm89"
    try:
        build_engine(BuildConfig(model, root / "rtx", target="tensorrt-rtx", gpu_arch=arch, **limits))
    except Exception as exc:  # e.g. a GPU TensorRT-RTX cannot build for (sm90)
        pytest.skip(f"tensorrt-rtx cannot build for this machine's {arch}: {exc}")
    build_engine(BuildConfig(model, root / "ort", **limits))
    return root / "rtx", root / "ort"


@needs_rtx
@pytest.mark.skipif(GPU_ARCH is not None, reason="this machine has a GPU")
def test_no_gpu_is_a_clear_error_before_tensorrt_is_touched(engines, monkeypatch):
    import tensorrt_rtx

    rtx_dir, _ = engines
    monkeypatch.setattr(tensorrt_rtx, "Runtime", lambda *a: pytest.fail("a TensorRT Runtime was created"))
    with pytest.raises(EngineError) as info:
        Engine(rtx_dir)
    message = str(info.value)
    assert "this engine targets tensorrt-rtx sm89 and needs an NVIDIA GPU with a driver; none found (" in message
    assert "cudaError" in message and "cannot run" in message
    with pytest.raises(RequestError, match="threads sets how many CPU cores ONNX Runtime uses; .* is a tensorrt-rtx "
                                           "engine"):
        Engine(rtx_dir, threads=1)  # refused before the GPU is looked for, not taken and ignored


@needs_rtx
@pytest.mark.skipif(GPU_ARCH is not None, reason="this machine has a GPU")
def test_serving_an_engine_this_machine_cannot_run_is_refused_before_the_server_starts(engines, monkeypatch):
    """Triton's model failed to load with a traceback in the server's log after it started; now one line first."""
    from typer.testing import CliRunner

    import camshaft.triton_repo.serve as triton_serve
    from camshaft.cli import app

    rtx_dir, _ = engines
    monkeypatch.setattr(triton_serve, "serve", lambda **kwargs: pytest.fail("Triton was started"))
    for api in ("triton", "openai"):
        result = CliRunner().invoke(app, ["serve", "--api", api, "--engine", str(rtx_dir)])
        assert isinstance(result.exception, EngineError), result.output
        assert "needs an NVIDIA GPU with a driver; none found" in str(result.exception)
    from camshaft.triton_repo.deploy import check_deployed_engine, deploy_repository

    repo = deploy_repository(rtx_dir, rtx_dir.parent / "repo")  # may be served elsewhere: written
    with pytest.raises(EngineError, match="serves the engine .* which does not run here: .*needs an NVIDIA GPU"):
        check_deployed_engine(repo)  # what serve --repo checks before Triton starts


class FakeCudart:
    """cuda-python's runtime calls the backend makes, over host memory (a 'device pointer' is a host address)."""

    class cudaError_t:  # noqa: N801 - mirrors cuda-python's names
        cudaSuccess = 0

    class cudaMemcpyKind:  # noqa: N801
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    class cudaDeviceAttr:  # noqa: N801
        cudaDevAttrComputeCapabilityMajor = "major"
        cudaDevAttrComputeCapabilityMinor = "minor"

    def __init__(self, arch: int = 89, devices: int = 1, free: int = 8 * 2**30) -> None:
        self.arch, self.devices, self.free = arch, devices, free
        self.allocations: dict[int, ctypes.Array] = {}
        self.freed: list[int] = []
        self.copies = 0
        self.out_of_memory = False

    def cudaMemGetInfo(self):  # noqa: N802
        return 0, self.free, 16 * 2**30

    def cudaGetDeviceCount(self):  # noqa: N802
        return 0, self.devices

    def cudaDeviceGetAttribute(self, attr, device):  # noqa: N802
        return 0, self.arch // 10 if attr == "major" else self.arch % 10

    def cudaMalloc(self, nbytes):  # noqa: N802
        if self.out_of_memory:
            return 2, 0  # cudaErrorMemoryAllocation
        buffer = (ctypes.c_char * nbytes)()
        self.allocations[ctypes.addressof(buffer)] = buffer
        return 0, ctypes.addressof(buffer)

    def cudaFree(self, ptr):  # noqa: N802
        self.freed.append(ptr)
        self.allocations.pop(ptr)
        return (0,)

    def cudaMemsetAsync(self, ptr, value, nbytes, stream):  # noqa: N802
        assert stream == 7
        ctypes.memset(ptr, value, nbytes)
        return (0,)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):  # noqa: N802
        ctypes.memmove(dst, src, nbytes)
        self.copies += 1
        return (0,)

    def cudaStreamCreate(self):  # noqa: N802
        return 0, 7

    def cudaStreamSynchronize(self, stream):  # noqa: N802
        assert stream == 7
        return (0,)

    def cudaStreamDestroy(self, stream):  # noqa: N802
        assert stream == 7
        self.streams_destroyed = getattr(self, "streams_destroyed", 0) + 1
        return (0,)


class OldDriverCudart(FakeCudart):
    """CUDA 13's runtime over a driver for CUDA `driver` (12080: 12.8; 0: no driver), as cuda-python reports it."""

    def __init__(self, driver: int) -> None:
        super().__init__()
        self.driver = driver

    def cudaGetDeviceCount(self):  # noqa: N802
        return types.SimpleNamespace(name="cudaErrorInsufficientDriver"), None

    def cudaDriverGetVersion(self):  # noqa: N802
        return 0, self.driver

    def cudaRuntimeGetVersion(self):  # noqa: N802
        return 0, 13040


def _view(ptr: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * max(nbytes, 1)).from_address(ptr), dtype=dtype,
                         count=int(np.prod(shape))).reshape(shape)


def fake_tensorrt(graph: Path, version: str, aliased: bool = False):
    """A TensorRT module whose plan is the float16 ONNX graph, executed by ONNX Runtime through bound addresses.
    Like a real plan of this graph (ScatterND writes a whole new cache), no output aliases an input unless
    `aliased` (as TensorRT's KVCacheUpdate would)."""
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    np_types = {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(int64)": np.int64,
                "tensor(bool)": np.bool_}
    io = {v.name: np.dtype(np_types[v.type]) for v in session.get_inputs() + session.get_outputs()}
    inputs = [v.name for v in session.get_inputs()]
    outputs = [v.name for v in session.get_outputs()]

    class Context:
        def __init__(self) -> None:
            self.shapes, self.addresses, self.runs = {}, {}, 0

        def set_input_shape(self, name, shape):
            assert name in inputs, name
            if "logits_index" == name and shape[0] < 1:  # the profile's minimum
                return False
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name, ptr):
            assert name in io, name
            self.addresses[name] = ptr
            return True

        def execute_async_v3(self, stream):
            feeds = {n: _view(self.addresses[n], self.shapes[n], io[n]).copy() for n in inputs}
            results = session.run(outputs, feeds)
            for name, value in zip(outputs, results, strict=True):
                _view(self.addresses[name], value.shape, io[name])[...] = value
            self.runs += 1
            return True

    class Plan:
        num_io_tensors = len(io)
        names = list(io)

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_dtype(self, name):
            return io[name]

        def get_aliased_input_tensor(self, name):
            return name.removesuffix("_out") if aliased and name.endswith("_out") else None

        def create_execution_context(self):
            self.context = Context()
            return self.context

    class Runtime:
        def __init__(self, logger) -> None:
            pass

        def deserialize_cuda_engine(self, blob):
            assert len(blob) > 1000
            self.plan = Plan()
            return self.plan

    import tensorrt_rtx

    return types.SimpleNamespace(__version__=version, Runtime=Runtime, ILogger=tensorrt_rtx.ILogger,
                                 nptype=lambda t: t, ComputeCapability=tensorrt_rtx.ComputeCapability)


@pytest.fixture()
def simulated(engines, monkeypatch):
    import tensorrt_rtx

    rtx_dir, ort_dir = engines
    cudart = FakeCudart()
    trt = fake_tensorrt(rtx_dir / GRAPH_NAME, tensorrt_rtx.__version__)
    monkeypatch.setattr(backend, "_cudart", lambda product, arch: cudart)
    monkeypatch.setattr(backend.TensorRTBackend, "_import", staticmethod(lambda product: trt))
    return rtx_dir, ort_dir, cudart


def test_backend_plumbing_against_simulated_cuda_and_tensorrt(simulated):
    rtx_dir, ort_dir, cudart = simulated
    engine = Engine(rtx_dir, max_sequences=3)
    reference = Engine(ort_dir, max_sequences=3)
    trt_backend = engine.backend
    kv = engine.manifest.kv_cache
    assert len(trt_backend.caches) == 2 * engine.manifest.model.num_layers
    assert trt_backend.kv_cache_bytes == 2 * len(trt_backend.caches) * trt_backend.num_blocks * kv.block_size * (
        kv.num_kv_heads * kv.head_dim) * 2  # two float16 buffers a cache
    context = trt_backend.context
    pairs = list(zip(kv.key_inputs + kv.value_inputs, kv.key_outputs + kv.value_outputs, strict=True))

    def bound() -> list[tuple[int, int]]:
        return [(context.addresses[name], context.addresses[out]) for name, out in pairs]

    # ScatterND's output is a new cache: each cache has a second buffer for it, and the two swap every step
    before = bound()
    assert all(i != o for i, o in before) and [i for i, _ in before] == [c.ptr for c in trt_backend.caches]

    rng = np.random.default_rng(0)
    vocab = engine.manifest.model.vocab_size
    ids = {k: rng.integers(3, vocab, n).tolist() for k, n in {"a": 19, "b": 7}.items()}
    tables = {k: engine.pool.allocate(-(-len(v) // BLOCK)) for k, v in ids.items()}
    schedule = [{"a": 12, "b": 3}, {"a": 6, "b": 4}, {"a": 1}]
    done = dict.fromkeys(ids, 0)
    for step in schedule:
        chunks = []
        for key, n in step.items():
            chunks.append(Chunk(ids[key][done[key]: done[key] + n], done[key], tables[key]))
            done[key] += n
        got, expected = engine.step(chunks), reference.step(chunks)
        assert got.dtype == np.float32 and got.shape == expected.shape == (len(chunks), vocab)
        scale = float(np.abs(expected).max())
        assert float(np.abs(got - expected).max()) <= 2e-2 * scale  # float16 graph vs float32 engine
    # A chunk asking for no logits: the plan still computes one row (profile minimum), the backend returns none.
    last = Chunk(ids["a"][-1:], done["a"] - 1, tables["a"], num_logits=0)
    assert engine.step([last]).shape == (0, vocab)
    assert context.runs == len(schedule) + 1
    assert bound() == (before if context.runs % 2 == 0 else [(o, i) for i, o in before])
    trt_backend.close()
    assert not cudart.allocations and cudart.streams_destroyed == 1
    assert trt_backend.context is trt_backend.engine is trt_backend.runtime is None  # the plan's memory too
    trt_backend.close()  # twice: nothing left to free


def test_step_buffers_are_reserved_at_load_before_the_pool_is_sized(simulated, monkeypatch):
    """Every feed's device buffer and the logits' are allocated at load, at the largest shapes of the plan's profile,
    before the free memory is measured: no step allocates, so a pool of nearly all the memory left cannot make a long
    step fail mid-serving. Memory too short for them fails the load, and a refused tensor address fails clearly."""
    rtx_dir, ort_dir, cudart = simulated
    events = []
    malloc, free = cudart.cudaMalloc, cudart.cudaMemGetInfo
    monkeypatch.setattr(cudart, "cudaMalloc", lambda nbytes: events.append(nbytes) or malloc(nbytes))
    monkeypatch.setattr(cudart, "cudaMemGetInfo", lambda: events.append("free memory") or free())
    engine, reference = Engine(rtx_dir, kv_cache_memory=0.5), Engine(ort_dir, max_sequences=4)
    trt_backend, limits = engine.backend, engine.manifest.limits
    assert events.index("free memory") == len(trt_backend._buffers)
    assert set(trt_backend._buffers) == {spec.name for spec in engine.manifest.inputs} | {"logits"}
    assert trt_backend._buffers["logits"].nbytes == limits.max_num_tokens * engine.manifest.model.vocab_size * 4
    allocated = len(events)
    ids = np.random.default_rng(1).integers(3, engine.manifest.model.vocab_size, 60).tolist()
    engines = {engine: [engine.pool.allocate(-(-60 // BLOCK)) for _ in range(2)],
               reference: [reference.pool.allocate(-(-60 // BLOCK)) for _ in range(2)]}
    steps = [[(0, 0, 2, 1), (1, 0, 2, 1)],  # (sequence, start, tokens, logits rows)
             [(0, 2, 30, 1)],
             [(0, 32, 28, 28), (1, 2, 1, 1)]]  # 29 tokens and 29 logits rows: the step's whole budget nearly
    for step in steps:
        got, expected = (e.step([Chunk(ids[start: start + n], start, tables[seq], num_logits=rows)
                                 for seq, start, n, rows in step]) for e, tables in engines.items())
        assert got.shape == expected.shape
        assert float(np.abs(got - expected).max()) <= 2e-2 * float(np.abs(expected).max())
    assert len(events) == allocated
    context = trt_backend.context
    monkeypatch.setattr(context, "set_tensor_address", lambda name, ptr: False)
    with pytest.raises(EngineError, match="TensorRT refused the device address of KV cache"):
        engine.step([Chunk(ids[3:4], 3, engines[engine][1])])  # the caches swap after the step
    held = len(cudart.allocations)
    malloc_calls = len(events)
    monkeypatch.setattr(cudart, "cudaMalloc", lambda nbytes: (2, 0) if len(events) > malloc_calls + 3 else
                        events.append(nbytes) or malloc(nbytes))  # the 4th allocation of the next load fails
    with pytest.raises(EngineError, match="cudaMalloc") as failed:  # its traceback, kept, holds the backend
        Engine(rtx_dir, max_sequences=2)
    assert failed.value and len(cudart.allocations) == held  # what the failed load had allocated is freed at once
    monkeypatch.setattr(cudart, "cudaStreamDestroy", lambda stream: (700,))  # the context broken: cleanup fails too
    with pytest.raises(EngineError, match="cudaMalloc") as failed:  # the load's own error, not the cleanup's
        Engine(rtx_dir, max_sequences=2)
    assert any("cudaStreamDestroy" in note for note in failed.value.__notes__)


def test_a_fractional_budget_is_of_the_gpu_memory_the_loaded_plan_leaves_and_capped_at_its_pool(simulated,
                                                                                                  monkeypatch):
    """A fraction is of the GPU memory free once the plan (its weights) and its context are loaded, as TensorRT-LLM's
    free_gpu_memory_fraction: measured before, 1.0 would leave the weights no room. A budget above the plan's pool
    is capped to it rather than refused."""
    from camshaft.runtime.kv_cache import bytes_per_block, memory_spec, plan_blocks
    from camshaft.runtime.llm import LLM

    rtx_dir, _, cudart = simulated
    manifest = Engine(rtx_dir, max_sequences=1).manifest
    assert memory_spec(0.5) == 0.5  # kept a fraction: the backend resolves it
    events = []
    trt = backend.TensorRTBackend._import("tensorrt-rtx")
    deserialize = trt.Runtime.deserialize_cuda_engine
    monkeypatch.setattr(trt.Runtime, "deserialize_cuda_engine",
                        lambda self, blob: events.append("plan") or deserialize(self, blob))
    free = cudart.cudaMemGetInfo
    monkeypatch.setattr(cudart, "cudaMemGetInfo", lambda: events.append("free memory") or free())
    cudart.free = 3 * 2**30
    most = plan_blocks(manifest)
    assert most is not None and Engine(rtx_dir, kv_cache_memory=0.5).pool.num_blocks == most  # capped, not refused
    assert events == ["plan", "free memory"]
    cudart.free = 5 * 2 * bytes_per_block(manifest)
    assert Engine(rtx_dir, kv_cache_memory=1.0).pool.num_blocks == 5  # two buffers a cache
    with LLM(rtx_dir, kv_cache_memory=1.0) as llm:
        assert llm.kv_cache_memory == 1.0 and llm.config.num_blocks == 5


def test_a_kv_budget_counts_both_buffers_of_each_cache(simulated):
    rtx_dir, _, _ = simulated
    manifest = Engine(rtx_dir, max_sequences=1).manifest
    from camshaft.runtime.kv_cache import bytes_per_block

    budget = 10 * 2 * bytes_per_block(manifest)  # room for 10 blocks of every cache, twice
    engine = Engine(rtx_dir, kv_cache_memory=budget)
    assert engine.pool.num_blocks == 10 and engine.backend.kv_cache_bytes <= budget
    from camshaft.runtime.llm import LLM
    from camshaft.runtime.throughput import llm_config

    with LLM(rtx_dir, kv_cache_memory=budget) as llm:  # what bench throughput reports as the pool's memory
        assert llm_config(llm)["kv_pool_bytes"] == budget


def test_a_cache_the_plan_aliases_is_bound_in_place(engines, monkeypatch):
    import tensorrt_rtx

    rtx_dir, _ = engines
    trt = fake_tensorrt(rtx_dir / GRAPH_NAME, tensorrt_rtx.__version__, aliased=True)
    monkeypatch.setattr(backend, "_cudart", lambda product, arch: FakeCudart())
    monkeypatch.setattr(backend.TensorRTBackend, "_import", staticmethod(lambda product: trt))
    engine = Engine(rtx_dir)
    trt_backend, kv = engine.backend, engine.manifest.kv_cache
    addresses = trt_backend.context.addresses
    for i, (name, out) in enumerate(zip(kv.key_inputs + kv.value_inputs, kv.key_outputs + kv.value_outputs,
                                        strict=True)):
        assert addresses[name] == addresses[out] == trt_backend.caches[i].ptr
    assert trt_backend.kv_cache_bytes == sum(c.nbytes for c in trt_backend.caches)  # one buffer a cache


def test_wrong_gpu_arch_and_version_and_pool_size(engines, monkeypatch):
    import tensorrt_rtx

    rtx_dir, _ = engines
    trt = fake_tensorrt(rtx_dir / GRAPH_NAME, tensorrt_rtx.__version__)
    monkeypatch.setattr(backend.TensorRTBackend, "_import", staticmethod(lambda product: trt))
    monkeypatch.setattr(backend, "_cudart", lambda product, arch: FakeCudart(arch=120))
    with pytest.raises(EngineError, match="built for sm89 but GPU 0 is sm120; rebuild it with --gpu-arch sm120$"):
        Engine(rtx_dir)
    monkeypatch.setattr(backend, "_cudart", lambda product, arch: FakeCudart(arch=90))  # H100: no tensorrt-rtx plan
    with pytest.raises(EngineError, match="GPU 0 is sm90; tensorrt-rtx .* cannot build for it: rebuild with "
                                          "--target tensorrt on this GPU"):
        Engine(rtx_dir)
    monkeypatch.setattr(backend, "_cudart", lambda product, arch: FakeCudart(devices=0))
    with pytest.raises(EngineError, match=r"none found \(no CUDA device\)"):
        Engine(rtx_dir)
    monkeypatch.setattr(backend, "_cudart", lambda product, arch: FakeCudart())
    with pytest.raises(EngineError, match="exceeds the .* blocks the plan was built for"):
        Engine(rtx_dir, max_sequences=50)
    for version in ("0.9.0", tensorrt_rtx.__version__ + ".1"):  # a plan runs only on the release that built it
        other = fake_tensorrt(rtx_dir / GRAPH_NAME, version)
        monkeypatch.setattr(backend.TensorRTBackend, "_import", staticmethod(lambda product, other=other: other))
        with pytest.raises(EngineError, match=f"built with tensorrt-rtx .* but {re.escape(version)} is installed"):
            Engine(rtx_dir)


@pytest.mark.skipif(GPU_ARCH is None, reason="needs an NVIDIA GPU with a driver; none here (the backend has never "
                                             "run on a GPU)")
def test_runs_on_a_gpu_and_matches_onnxruntime(engines):
    rtx_dir, ort_dir = engines
    engine, reference = Engine(rtx_dir, max_sequences=2), Engine(ort_dir, max_sequences=2)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, engine.manifest.model.vocab_size, 13).tolist()
    table = engine.pool.allocate(-(-len(ids) // BLOCK))
    for start, n in ((0, 9), (9, 3), (12, 1)):
        chunks = [Chunk(ids[start: start + n], start, table)]
        got, expected = engine.step(chunks), reference.step(chunks)
        assert float(np.abs(got - expected).max()) <= 2e-2 * float(np.abs(expected).max())


@needs_rtx
def test_a_driver_older_than_cuda_python_is_told_apart_from_no_gpu(engines, monkeypatch):
    """cudaErrorInsufficientDriver means no driver at all or one too old for cuda-python's CUDA: the second is
    a GPU whose driver needs an update, not a machine to leave, when running an engine or building on the GPU."""
    from cuda import bindings

    from camshaft.builder.targets.trt_product import supported_archs
    from camshaft.errors import BuildConfigError

    rtx_dir, _ = engines
    monkeypatch.setattr(backend, "_cudart", lambda product, arch: OldDriverCudart(12080))
    with pytest.raises(EngineError, match=r"targets tensorrt-rtx sm89, and the NVIDIA driver here supports CUDA "
                                          r"12\.8, older than the CUDA 13\.4 cuda-python runs on .*update the driver"):
        Engine(rtx_dir)
    monkeypatch.setattr(backend, "_cudart", lambda product, arch: OldDriverCudart(0))
    with pytest.raises(EngineError, match=r"none found \(cudaErrorInsufficientDriver\)"):
        Engine(rtx_dir)
    monkeypatch.setattr(bindings, "runtime", OldDriverCudart(12080))
    with pytest.raises(BuildConfigError, match=r"the tensorrt target builds plans on the GPU, and the NVIDIA driver "
                                               r"here supports CUDA 12\.8"):
        supported_archs(None, "tensorrt")


def test_a_gpu_whose_compute_capability_cannot_be_read_is_no_usable_gpu():
    from camshaft.cuda_gpu import probe_gpu0

    cudart = FakeCudart()
    assert probe_gpu0(cudart).arch == 89
    cudart.cudaDeviceGetAttribute = lambda attr, device: (3, None) if attr == "minor" else (0, 8)
    probe = probe_gpu0(cudart)  # a TypeError (None arithmetic) before
    assert probe.arch is None and probe.reason == "GPU 0's compute capability: 3"


@needs_rtx
def test_deploying_a_tensorrt_engine_with_threads_is_refused_before_the_repository_is_written(engines, tmp_path):
    """Review: deploy --threads wrote a repository whose model could never load (LLM refuses threads for a TensorRT
    engine), found only in tritonserver's log."""
    from typer.testing import CliRunner

    from camshaft.cli import app

    rtx_dir, _ = engines
    result = CliRunner().invoke(app, ["deploy", "--engine", str(rtx_dir), "--repo", str(tmp_path / "repo"),
                                      "--threads", "1"])
    assert isinstance(result.exception, RequestError), result.output
    assert "--threads sets how many CPU cores ONNX Runtime uses" in str(result.exception)
    assert "drop --threads" in str(result.exception) and not (tmp_path / "repo").exists()
