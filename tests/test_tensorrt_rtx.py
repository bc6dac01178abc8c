"""TensorRT-RTX plans built ahead of time on the CPU from every tiny variant's float16 and bfloat16 graphs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from camshaft.builder.build import write_graph
from camshaft.builder.checkpoint import Checkpoint
from camshaft.errors import BuildConfigError
from camshaft.manifest import BuildLimits

from tiny_models import TRT_VARIANTS, make_tiny_model

pytestmark = [
    pytest.mark.tensorrt,
    pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                       reason="tensorrt_rtx is not installed (pip install 'camshaft[tensorrt-rtx]')"),
]

LIMITS = BuildLimits(max_batch_size=4, max_seq_len=128, max_num_tokens=32, kv_block_size=4)
NUM_BLOCKS = 64


def fp16_graph(root: Path, name: str, dtype: str = "float16") -> Path:
    model_dir = make_tiny_model(name, root / name)
    out = root / f"{name}-graph"
    out.mkdir()
    with Checkpoint(model_dir) as checkpoint:
        return write_graph(checkpoint, LIMITS, dtype, out)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(TRT_VARIANTS))
def test_builds_sm89_plan(tmp_path: Path, name: str, dtype: str) -> None:
    import tensorrt_rtx

    from camshaft.builder.targets.tensorrt import build_plan

    graph = fp16_graph(tmp_path, name, dtype)
    plan = tmp_path / "engine" / "model.plan"
    meta = build_plan(graph, plan, product="tensorrt-rtx", gpu_arch="sm89", limits=LIMITS,
                      num_blocks_max=NUM_BLOCKS)
    assert plan.is_file() and plan.stat().st_size > 0
    assert meta["plan_bytes"] == plan.stat().st_size
    assert meta["product"] == "tensorrt-rtx"
    assert meta["version"] == tensorrt_rtx.__version__
    assert meta["gpu_arch"] == "sm89"
    assert meta["build_seconds"] > 0
    assert not list(plan.parent.glob(".*")), "the atomic write left a temporary file behind"


def test_unsupported_arch_is_a_clear_error(tmp_path: Path) -> None:
    from camshaft.builder.targets.tensorrt import build_plan

    plan = tmp_path / "model.plan"
    with pytest.raises(BuildConfigError, match=r"sm90.*sm89") as info:
        build_plan(tmp_path / "missing.onnx", plan, product="tensorrt-rtx", gpu_arch="sm90", limits=LIMITS,
                   num_blocks_max=NUM_BLOCKS)
    assert "sm120" in str(info.value)
    with pytest.raises(BuildConfigError, match="not a GPU architecture"):
        build_plan(tmp_path / "missing.onnx", plan, product="tensorrt-rtx", gpu_arch="hopper", limits=LIMITS,
                   num_blocks_max=NUM_BLOCKS)
    assert not plan.exists()


def test_arch_spellings() -> None:
    from camshaft.builder.targets.trt_product import parse_arch

    assert {parse_arch(a) for a in ("sm89", "SM_89", "89", "8.9")} == {89}
    assert parse_arch("sm120") == 120 and parse_arch("12.0") == 120
    from camshaft.builder.config import BuildConfig

    with pytest.raises(BuildConfigError, match="--gpu-arch is empty"):  # an unset $ARCH built sm89 silently
        BuildConfig("model", "engine", target="tensorrt-rtx", gpu_arch="")
    with pytest.raises(BuildConfigError, match="gpu_arch is a string .e.g. \"sm89\"., got 89"):  # not AttributeError
        BuildConfig("model", "engine", target="tensorrt-rtx", gpu_arch=89)


def test_parser_errors_name_the_node(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    from camshaft.builder.targets.tensorrt import build_plan

    node = helper.make_node("NoSuchOp", ["x"], ["y"], name="the_bad_node", domain="camshaft.test")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["T", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["T", 4])])
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("camshaft.test", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    path = tmp_path / "bad.onnx"
    onnx.save(model, path)
    with pytest.raises(BuildConfigError, match=r"cannot parse(.|\n)*the_bad_node \(NoSuchOp\)"):
        build_plan(path, tmp_path / "model.plan", product="tensorrt-rtx", gpu_arch="sm89", limits=LIMITS,
                   num_blocks_max=NUM_BLOCKS)


def stored_as_bfloat16(model: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    for file in model.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    return model


@pytest.mark.parametrize(("dtype", "stored", "base"), [("auto", "float32", "float16"), ("bfloat16", "float32",
                                                       "bfloat16"), ("auto", "bfloat16", "bfloat16")])
def test_build_engine_for_tensorrt_rtx_records_plan_and_graph(tmp_path, dtype, stored, base):
    """--dtype auto builds the checkpoint's own half type (as trtllm-build's auto), float16 for a float32 one."""
    import onnx

    from camshaft.builder.build import GRAPH_NAME, build_engine, file_sha256
    from camshaft.builder.config import BuildConfig
    from camshaft.errors import EngineError
    from camshaft.runtime.engine import Engine

    model = make_tiny_model("qwen3-qknorm", tmp_path / "hf")
    if stored == "bfloat16":
        stored_as_bfloat16(model)
    out = tmp_path / "engine"
    config = BuildConfig(model, out, target="tensorrt-rtx", max_seq_len=64, max_batch_size=4, max_num_tokens=32,
                         kv_block_size=8, dtype=dtype)
    if stored == "bfloat16":  # a GPU without bfloat16 kernels (sm75) gets float16 from auto
        assert config.resolved_dtype(stored, 75) == "float16" and config.resolved_dtype(stored, 80) == "bfloat16"
    manifest = build_engine(config)
    assert manifest.target == "tensorrt-rtx" and manifest.dtype == base and manifest.kv_cache.dtype == base
    elem = onnx.helper.tensor_dtype_to_np_dtype(
        onnx.load(out / GRAPH_NAME, load_external_data=False).graph.input[-1].type.tensor_type.elem_type)
    assert elem.name == base  # the plan's source graph carries the base type (KV cache inputs)
    assert manifest.artifact == "model.plan" and (out / "model.plan").stat().st_size > 100_000
    assert manifest.graph_sha256 == file_sha256(out / GRAPH_NAME)
    assert manifest.target_options["gpu_arch"] == "sm89"
    assert manifest.tools["tensorrt-rtx"] == manifest.target_options["version"]
    with pytest.raises(EngineError, match="cannot run"):
        Engine(out)


def test_unbuildable_arch_fails_before_any_work(tmp_path):
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    model = make_tiny_model("llama", tmp_path / "hf")
    with pytest.raises(BuildConfigError, match="sm90"):
        build_engine(BuildConfig(model, tmp_path / "engine", target="tensorrt-rtx", gpu_arch="sm90"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]




def test_gemma_is_never_built_in_float16(tmp_path):
    """Review: Gemma 3 built in float16 (asked, or auto from a float32 checkpoint) without a word, and its residual
    stream (~1e5 in transformers) overflowed to NaN logits; auto now builds bfloat16, float16 is refused."""
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    model = make_tiny_model("gemma3", tmp_path / "hf")
    small = dict(max_seq_len=64, max_batch_size=2, max_num_tokens=32, kv_block_size=8)
    for given in (dict(dtype="float16"), dict(gpu_arch="sm75")):  # asked; auto where no bfloat16 kernels are
        with pytest.raises(BuildConfigError, match="gemma3's activations exceed float16's range"):
            build_engine(BuildConfig(model, tmp_path / "engine", target="tensorrt-rtx", **given, **small))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    auto = BuildConfig(model, tmp_path / "engine", target="tensorrt-rtx", **small)
    assert auto.resolved_dtype("float32", 89, "gemma3") == "bfloat16"
    assert auto.resolved_dtype("float16", None, "gemma3") == "bfloat16"
    assert auto.resolved_dtype("float32", 89, "llama") == auto.resolved_dtype("float32", 75, "gemma3") == "float16"
    assert build_engine(auto).dtype == "bfloat16"


def test_a_stop_during_the_plan_build_cancels_it_and_writes_nothing(tmp_path):
    """TensorRT catches what its Python callbacks raise, where a signal's KeyboardInterrupt lands while it builds:
    the build is cancelled through its progress monitor and the stop raised once TensorRT returns (it finished the
    build and exited 0 before), and the monitor says the build's phases as they start."""
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    model = make_tiny_model("llama", tmp_path / "hf")
    said = []

    def progress(line: str) -> None:
        said.append(line)
        if line.startswith("Building engine"):  # a Ctrl-C arriving as TensorRT reports its first phase
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_engine(BuildConfig(model, tmp_path / "engine", target="tensorrt-rtx", gpu_arch="sm89", **LIMITS_KW),
                     progress=progress)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and "tensorrt-rtx plan:" not in " ".join(said)
    built = []
    build_engine(BuildConfig(model, tmp_path / "engine", target="tensorrt-rtx", gpu_arch="sm89", **LIMITS_KW),
                 progress=built.append)
    assert any(line.startswith("Building engine (") for line in built) and (tmp_path / "engine").is_dir()


LIMITS_KW = dict(max_batch_size=4, max_seq_len=64, max_num_tokens=32, kv_block_size=4)


@pytest.mark.parametrize("stop, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_real_signal_during_the_plan_build_stops_it(tmp_path, stop, code):
    """A signal's handler runs as TensorRT's next callback starts, before the callback could catch what it raises:
    the stop is kept while TensorRT runs, the build cancelled, and the command exits as stopped with nothing written
    (it printed "Exception caught in log()" and wrote the engine, exit 0)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    model = make_tiny_model("llama", tmp_path / "hf", num_hidden_layers=8, hidden_size=256, intermediate_size=512)
    build = subprocess.Popen([sys.executable, "-c", "from camshaft.cli import main; main()", "build", "--model",
                              str(model), "--output", str(tmp_path / "engine"), "--target", "tensorrt-rtx",
                              "--gpu-arch", "sm89", "--max-seq-len", "256", "--max-batch-size", "8"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ,
                             # a runner started in the background (`.ci/run &`) hands its children SIGINT ignored
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    said = []
    for line in build.stderr:
        said.append(line)
        if "Building engine" in line:
            time.sleep(0.3)  # TensorRT is building now
            build.send_signal(getattr(signal, stop))
    assert build.wait(timeout=300) == code, "".join(said)
    assert not (tmp_path / "engine").exists() and "plan:" not in "".join(said)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_plan_that_does_not_load_keeps_tensorrts_reason() -> None:
    """The runtime's logger keeps what TensorRT said about a plan it could not load, which the backend's load error
    quotes (a damaged plan: reading one needs no GPU), and leaves out TensorRT's note on a second logger."""
    from collections import deque

    import tensorrt_rtx

    from camshaft.trt_logger import capturing_logger

    for _ in range(2):  # the second runtime of the process hears its own error too
        messages: deque[str] = deque(maxlen=10)
        runtime = tensorrt_rtx.Runtime(capturing_logger(tensorrt_rtx, messages))
        assert runtime.deserialize_cuda_engine(b"not a plan" * 100) is None
        assert any("magic" in m.lower() for m in messages), list(messages)
        assert not any("logger passed into" in m for m in messages)


def test_the_profile_holds_no_more_rows_than_a_step_has_tokens() -> None:
    """Each row of a step (a decoding sequence, a prefill chunk) takes one token of max_num_tokens at least: a larger
    batch limit would tune kernels and size the context's memory for steps that never come."""
    from camshaft.builder.targets.tensorrt import profile_ranges

    few = profile_ranges(BuildLimits(max_batch_size=8, max_seq_len=64, max_num_tokens=4, kv_block_size=8), 16)
    assert (few["Bd"], few["Bp"], few["N"], few["T"]) == ((1, 4, 4), (1, 1, 4), (1, 4, 4), (1, 4, 4))
    many = profile_ranges(LIMITS, NUM_BLOCKS)
    assert (many["Bd"], many["Bp"], many["N"]) == ((1, 4, 4), (1, 1, 4), (1, 4, 32))
