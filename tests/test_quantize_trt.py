"""Quantized checkpoints for the TensorRT targets: every weight format lowers to standard Q/DQ (int8 / float8
activations, int4 blocked / int8 per-channel / float8 weights) that tensorrt-rtx 1.7 parses and builds ahead of time
on the CPU (sm89); all are enabled for the targets. Quantized KV caches are refused before any work. The plans never
run here (no GPU); the same Q/DQ graph in float32 is checked against ModelOpt's fake-quant model in
tests/test_quantize.py.
"""

from __future__ import annotations

import importlib.util

import onnx
import pytest

from camshaft.builder.build import GRAPH_NAME, build_engine
from camshaft.builder.config import BuildConfig
from camshaft.builder.quantized import READABLE_QUANT_ALGOS
from camshaft.builder.target_checks import TRT_QUANT_ALGOS, check_quantized_target
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
BUILD = dict(max_seq_len=64, max_batch_size=4, max_num_tokens=32, kv_block_size=8)
WEIGHT_TYPES = {"fp8": onnx.TensorProto.FLOAT8E4M3FN, "w4a8_awq": onnx.TensorProto.INT4,
                "int4_awq": onnx.TensorProto.INT4, "int4_wo": onnx.TensorProto.INT4, "int8_wo": onnx.TensorProto.INT8,
                "int8_sq": onnx.TensorProto.INT8, "int8_sq_mixed": onnx.TensorProto.INT8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("trtq") / "hf")


@pytest.mark.parametrize("fmt", sorted(WEIGHT_TYPES))
def test_quantized_formats_build_tensorrt_rtx_plans(tiny, tmp_path, fmt):
    quantize_checkpoint(tiny, tmp_path / "ckpt", QuantSpec(fmt), **CALIB)
    out = tmp_path / "engine"
    assert set(FORMATS[fmt].layer_algos) <= set(TRT_QUANT_ALGOS)
    manifest = build_engine(BuildConfig(tmp_path / "ckpt", out, target="tensorrt-rtx", **BUILD))
    assert manifest.dtype == "float16" and manifest.quantization["quantized_linear_layers"] == 14
    assert manifest.quantization["lowering"].startswith("standard Q/DQ")
    assert manifest.quantization["accuracy_level"] is None  # no MatMulNBits on the TensorRT targets
    graph_path = out / GRAPH_NAME
    assert (out / "model.plan").stat().st_size > 100_000
    graph = onnx.load(graph_path, load_external_data=False)
    assert not any(n.domain for n in graph.graph.node)  # standard ONNX only
    weights = [t for t in graph.graph.initializer if t.data_type == WEIGHT_TYPES[fmt] and len(t.dims) == 2]
    assert len(weights) == 10  # per layer: fused q/k/v, o, gate, up, down
    dq = {n.input[0] for n in graph.graph.node if n.op_type == "DequantizeLinear"}
    assert {t.name for t in weights} <= dq
    scales = {n.input[1] for n in graph.graph.node if n.op_type == "QuantizeLinear"}
    assert all(t.data_type == onnx.TensorProto.FLOAT16 for t in graph.graph.initializer if t.name in scales)
    # The same checkpoint over a bfloat16 base (sm80+; sm89 here): scales and weights' float type follow it.
    bf16 = build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "bf16", target="tensorrt-rtx", dtype="bfloat16",
                                    **BUILD))
    assert bf16.dtype == "bfloat16" and (tmp_path / "bf16" / "model.plan").stat().st_size > 100_000
    graph = onnx.load(tmp_path / "bf16" / GRAPH_NAME, load_external_data=False)
    scales = {n.input[1] for n in graph.graph.node if n.op_type == "QuantizeLinear"}
    assert all(t.data_type == onnx.TensorProto.BFLOAT16 for t in graph.graph.initializer if t.name in scales)


def test_dtype_auto_follows_the_model_a_checkpoint_was_quantized_from(tmp_path):
    """The quantized export is float32 whatever the model: the quantize record keeps the model's own type, which
    --dtype auto builds (a bfloat16 model: bfloat16 with or without --quant)."""
    from test_tensorrt_rtx import stored_as_bfloat16

    from camshaft.builder.checkpoint import Checkpoint

    model = stored_as_bfloat16(make_tiny_model("llama", tmp_path / "hf"))
    quantize_checkpoint(model, tmp_path / "ckpt", QuantSpec("int8_wo"), **CALIB)
    with Checkpoint(tmp_path / "ckpt") as ckpt:
        assert ckpt.float_dtype == "bfloat16" and ckpt.quantization["camshaft"]["source_dtype"] == "bfloat16"
    built = build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine", target="tensorrt-rtx", **BUILD))
    assert built.dtype == "bfloat16"


def test_quantized_kv_cache_is_refused_before_any_work(tiny, tmp_path):
    with pytest.raises(BuildConfigError, match=r"cannot build a KV cache in fp8: .*TensorRT rejects the float8 pool"):
        check_quantized_target("tensorrt", "FP8", "FP8")
    with pytest.raises(BuildConfigError, match=r"cannot build a KV cache in int8 \(with --quant int4_awq\): camshaft "
                                               r"lowers quantized KV caches for onnxruntime only\. "
                       r"It builds --quant fp8 \| int8_sq \| int8_sq_mixed \| int8_wo \| int4_wo \| int4_awq \| "
                       r"w4a8_awq without --kv-cache-dtype"):
        check_quantized_target("tensorrt-rtx", "W4A16_AWQ", "INT8", shown_as="--quant int4_awq")
    per_token = {name for name, fmt in FORMATS.items()
                 if any(READABLE_QUANT_ALGOS[algo].per_token for algo in fmt.layer_algos)}
    assert per_token == {"fp8_pc_pt", "int8_sq_pt"}
    for name, fmt in FORMATS.items():
        for algo in fmt.layer_algos if name not in per_token else ():
            check_quantized_target("tensorrt-rtx", algo)
    for algo in ("FP8_PER_CHANNEL_PER_TOKEN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"):
        with pytest.raises(BuildConfigError, match=f"cannot build {algo} checkpoints: the inputs take per-token"):
            check_quantized_target("tensorrt", algo)
    with pytest.raises(BuildConfigError, match="cannot build NVFP4 checkpoints"):
        check_quantized_target("onnxruntime", "NVFP4")
    for fmt in FORMATS.values():
        for algo in fmt.layer_algos:
            check_quantized_target("onnxruntime", algo, "INT8")
    quantize_checkpoint(tiny, tmp_path / "ckpt", QuantSpec("int8_sq", kv_cache_dtype="int8"), **CALIB)
    with pytest.raises(BuildConfigError, match="--target onnxruntime"):
        build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine", target="tensorrt-rtx"))
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("head", ["int4", "int8"])
def test_quantized_lm_head_builds_tensorrt_rtx_plan(tiny, tmp_path, head):
    quantize_checkpoint(tiny, tmp_path / "ckpt", QuantSpec("int8_wo", lm_head=head), **CALIB)
    manifest = build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine", target="tensorrt-rtx", **BUILD))
    assert manifest.quantization["lm_head"]["dtype"] == head
    assert manifest.quantization["lm_head"]["lowering"].startswith("standard Q/DQ")
    assert (tmp_path / "engine" / "model.plan").stat().st_size > 100_000
    graph = onnx.load(tmp_path / "engine" / GRAPH_NAME, load_external_data=False).graph
    vocab, hidden = manifest.model.vocab_size, manifest.model.hidden_size
    head_weight = next(t for t in graph.initializer if tuple(t.dims) == (hidden, vocab))
    assert head_weight.data_type == WEIGHT_TYPES[f"{head}_wo"]
