"""Quantized checkpoints for the TensorRT targets: FP8 and W4A8 AWQ lower to standard Q/DQ (float8 activations,
float8 or blocked int4 weights) that tensorrt-rtx 1.7 parses and builds ahead of time on the CPU (sm89); the other
formats are refused before any work. The plans never run here (no GPU): their numerics are unchecked.
"""

from __future__ import annotations

import importlib.util

import onnx
import pytest

from camshaft.builder.build import GRAPH_NAME, build_engine, check_quantized_target
from camshaft.builder.config import BuildConfig
from camshaft.errors import BuildConfigError
from camshaft.quantize.modelopt_adapter import quantize_checkpoint
from camshaft.quantize.spec import FORMATS, QuantSpec

from tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.tensorrt,
    pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                       reason="tensorrt_rtx is not installed (pip install 'camshaft[tensorrt-rtx]')"),
]
pytest.importorskip("modelopt.torch.quantization")

CALIB = dict(calib_size=2, calib_seq_len=32)
WEIGHT_TYPES = {"fp8": onnx.TensorProto.FLOAT8E4M3FN, "w4a8_awq": onnx.TensorProto.INT4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("trtq") / "hf")


@pytest.mark.parametrize("fmt", ["fp8", "w4a8_awq"])
def test_fp8_and_w4a8_build_tensorrt_rtx_plans(tiny, tmp_path, fmt):
    quantize_checkpoint(tiny, tmp_path / "ckpt", QuantSpec(fmt), **CALIB)
    out = tmp_path / "engine"
    manifest = build_engine(BuildConfig(tmp_path / "ckpt", out, target="tensorrt-rtx", max_seq_len=64,
                                        max_batch_size=4, max_num_tokens=32, kv_block_size=8))
    assert manifest.dtype == "float16" and (out / "model.plan").stat().st_size > 100_000
    assert manifest.quantization["format"] == fmt and manifest.quantization["quantized_linear_layers"] == 14
    graph = onnx.load(out / GRAPH_NAME, load_external_data=False)
    weights = [t for t in graph.graph.initializer if t.data_type == WEIGHT_TYPES[fmt] and len(t.dims) == 2]
    assert len(weights) == 8  # per layer: fused q/k/v, o, fused gate/up, down
    scales = {n.input[1] for n in graph.graph.node if n.op_type == "QuantizeLinear"}
    assert all(t.data_type == onnx.TensorProto.FLOAT16 for t in graph.graph.initializer if t.name in scales)


def test_other_quantized_formats_are_refused_before_any_work(tiny, tmp_path):
    for fmt in ("int8_sq", "int8_wo", "int4_wo", "int4_awq"):
        with pytest.raises(BuildConfigError, match=f"cannot build {FORMATS[fmt].checkpoint_algo} checkpoints"):
            check_quantized_target("tensorrt-rtx", FORMATS[fmt].checkpoint_algo)
    with pytest.raises(BuildConfigError, match="FP8 with a FP8 KV cache"):
        check_quantized_target("tensorrt", "FP8", "FP8")
    check_quantized_target("onnxruntime", "W8A8_SQ_PER_CHANNEL", "INT8")
    quantize_checkpoint(tiny, tmp_path / "ckpt", QuantSpec("int8_sq"), **CALIB)
    with pytest.raises(BuildConfigError, match="--target onnxruntime"):
        build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine", target="tensorrt-rtx"))
    assert not (tmp_path / "engine").exists()
