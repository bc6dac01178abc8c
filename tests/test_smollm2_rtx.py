"""SmolLM2-135M-Instruct builds real TensorRT-RTX plans ahead of time for sm89 on this CPU, in fp16, fp8, int8 (W8A8
SmoothQuant) and int4 weight-only. Each plan is built from the engine's own graph: the manifest records the graph's
hash, which is checked against the graph kept in the engine directory, and the product, version and architecture.
A build check, not an accuracy one: the smallest calibration that works and small limits. The plans never run here
(no GPU TensorRT-RTX targets); numerics of the lowering are in tests/test_trt_lowering_numerics.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import onnx
import pytest

from camshaft.builder.build import GRAPH_NAME, build_engine, file_sha256
from camshaft.builder.config import BuildConfig
from camshaft.manifest import MANIFEST_NAME, read_manifest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.tensorrt,
    pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                       reason="tensorrt_rtx is not installed (pip install 'camshaft[tensorrt-rtx]')"),
]

CALIB = dict(calib_size=2, calib_seq_len=32)
BUILD = dict(max_batch_size=4, max_seq_len=256, max_num_tokens=128)
# Quantized weight element type per format; 30 layers × (fused q/k/v, o, gate, up, down).
WEIGHT_TYPES = {"fp8": onnx.TensorProto.FLOAT8E4M3FN, "int8_sq": onnx.TensorProto.INT8,
                "int4_wo": onnx.TensorProto.INT4}
LAYERS = 30


def _source(fmt: str, smollm2_dir: Path, root: Path) -> Path:
    if fmt == "fp16":
        return smollm2_dir
    pytest.importorskip("modelopt.torch.quantization")
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    quantize_checkpoint(smollm2_dir, root / "ckpt", QuantSpec(fmt), **CALIB)
    return root / "ckpt"


@pytest.mark.parametrize("fmt", ["fp16", "fp8", "int8_sq", "int4_wo"])
def test_smollm2_builds_sm89_plan_from_its_own_graph(smollm2_dir: Path, tmp_path: Path, fmt: str) -> None:
    import tensorrt_rtx

    out = tmp_path / "engine"
    built = build_engine(BuildConfig(_source(fmt, smollm2_dir, tmp_path), out, target="tensorrt-rtx",
                                     gpu_arch="sm89", **BUILD))
    try:
        manifest = read_manifest(out)
        assert manifest == built and manifest.target == "tensorrt-rtx" and manifest.artifact == "model.plan"
        assert manifest.graph_sha256 == file_sha256(out / GRAPH_NAME)
        options = json.loads((out / MANIFEST_NAME).read_text())["target_options"]
        assert options["product"] == "tensorrt-rtx" and options["version"] == tensorrt_rtx.__version__
        assert options["gpu_arch"] == "sm89" and manifest.tools["tensorrt-rtx"] == tensorrt_rtx.__version__
        plan = (out / "model.plan").stat().st_size
        assert plan == options["plan_bytes"] == manifest.files["model.plan"]
        assert manifest.dtype == "float16" and plan > 50_000_000
        if fmt == "fp16":
            assert not manifest.quantization
            return
        assert manifest.quantization["format"] == fmt
        assert manifest.quantization["quantized_linear_layers"] == 7 * LAYERS
        assert manifest.quantization["lowering"].startswith("standard Q/DQ")
        graph = onnx.load(out / GRAPH_NAME, load_external_data=False).graph
        weights = [t for t in graph.initializer if t.data_type == WEIGHT_TYPES[fmt] and len(t.dims) == 2]
        assert len(weights) == 5 * LAYERS
    finally:
        shutil.rmtree(out, ignore_errors=True)  # ~0.5 GB each
