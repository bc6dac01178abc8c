"""Static check of graphs against TensorRT's published ONNX operator matrix (builder/targets/tensorrt_onnx_ops.json)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from camshaft.builder.build import write_graph
from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.targets.trt_support import check_graph, load_matrix, require_supported
from camshaft.errors import BuildConfigError
from camshaft.manifest import BuildLimits

from tiny_models import TRT_VARIANTS, make_tiny_model

LIMITS = BuildLimits(max_batch_size=4, max_seq_len=64, max_num_tokens=16, kv_block_size=4)


def graph(root: Path, name: str, dtype: str) -> Path:
    model_dir = root / "hf"
    if not model_dir.exists():
        make_tiny_model(name, model_dir)
    out = root / dtype
    out.mkdir()
    with Checkpoint(model_dir) as checkpoint:
        return write_graph(checkpoint, LIMITS, dtype, out)


def one_node(op: str, elem: int = TensorProto.FLOAT16, domain: str = "", opset: int = 23, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], name="the_node", domain=domain, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, ["T", 4])],
                          [helper.make_tensor_value_info("y", elem, ["T", 4])])
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(g, opset_imports=opsets)


def test_matrix_records_version_source_and_our_operators() -> None:
    matrix = load_matrix()
    assert matrix["version"] == "10.15" and "operators.md" in matrix["source"]["path"]
    ops = matrix["operators"]
    # Spot checks against the published page (TensorRT 10.15).
    assert ops["Attention"]["types"] == ["FP32", "FP16", "BF16", "INT8", "FP8"] and "4D" in ops["Attention"][
        "restrictions"]
    assert ops["ScatterND"]["types"] == ["FP32", "FP16", "BF16", "INT32", "INT64"]
    assert ops["MatMul"]["types"] == ["FP32", "FP16", "BF16"]
    assert ops["RotaryEmbedding"]["since"] == "10.15" and ops["Attention"]["since"] == "10.14"
    assert ops["Shape"]["types"][-1] == "BOOL" and "INT64" in ops["Gather"]["types"]
    assert ops["MatMulInteger"]["supported"] is False
    used = {"Gather", "ScatterND", "Attention", "RotaryEmbedding", "RMSNormalization", "MatMul", "Gemm", "Reshape",
            "Split", "Concat", "Squeeze", "Unsqueeze", "Shape", "Mul", "Add", "Sigmoid", "Cast", "Identity"}
    assert all(ops[op]["supported"] for op in used)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(TRT_VARIANTS))
def test_every_tiny_low_precision_graph_passes(tmp_path: Path, name: str, dtype: str) -> None:
    path = graph(tmp_path, name, dtype)
    onnx.checker.check_model(str(path), full_check=True)  # a valid ONNX graph (strict shape inference included)
    assert check_graph(path, "tensorrt-rtx") == []
    assert check_graph(path, "tensorrt", "10.15") == []
    require_supported(path, "tensorrt-rtx")
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert {"Attention", "RotaryEmbedding", "RMSNormalization", "ScatterND"} <= ops


def test_fp32_attention_fails_for_rtx_only(tmp_path: Path) -> None:
    path = graph(tmp_path, "llama", "float32")
    problems = check_graph(path, "tensorrt-rtx")
    assert problems and all("(Attention)" in p and "FP32" in p for p in problems)
    assert check_graph(path, "tensorrt", "10.15") == []


def test_older_tensorrt_lacks_the_llm_operators(tmp_path: Path) -> None:
    problems = check_graph(graph(tmp_path, "qwen3-qknorm", "float16"), "tensorrt", "10.14.1")
    assert problems and any("RotaryEmbedding only since 10.15" in p for p in problems)


def test_contrib_domain_operator_is_named() -> None:
    model = one_node("SkipSimplifiedLayerNormalization", domain="com.microsoft")
    with pytest.raises(BuildConfigError, match=r"the_node \(SkipSimplifiedLayerNormalization\).*com\.microsoft"):
        require_supported(model, "tensorrt-rtx")


def test_unknown_and_unsupported_operators_and_types() -> None:
    assert check_graph(one_node("Relu")) == []
    [problem] = check_graph(one_node("Hardmax", elem=TensorProto.INT32))
    assert "the_node (Hardmax)" in problem and "INT32" in problem
    [problem] = check_graph(one_node("Sigmoid", elem=TensorProto.DOUBLE))
    assert "DOUBLE" in problem
    [problem] = check_graph(one_node("MatMulInteger"))
    assert "marked unsupported" in problem
    [problem] = check_graph(one_node("NoSuchOp"))
    assert "not in TensorRT's ONNX support matrix" in problem
    [problem] = check_graph(one_node("Relu", opset=25))
    assert "opset 25" in problem


def test_attention_restrictions() -> None:
    f16 = TensorProto.FLOAT16
    inputs = [helper.make_tensor_value_info(n, f16, ["B", "L", 8]) for n in ("q", "k", "v", "pk")]
    node = helper.make_node("Attention", ["q", "k", "v", "", "pk"], ["y", "present_k"], name="attn", q_num_heads=2,
                            kv_num_heads=2)
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", f16, None)])
    problems = check_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]))
    assert any("past_key" in p for p in problems) and any("only the first output" in p for p in problems)
    assert all(p.startswith("node attn (Attention)") for p in problems)


def test_build_engine_checks_before_building(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("tensorrt_rtx")
    from camshaft.builder import build
    from camshaft.builder.config import BuildConfig
    from camshaft.builder.targets import tensorrt, trt_support

    seen = []
    monkeypatch.setattr(trt_support, "check_graph", lambda path, product, version: seen.append(
        (Path(path).name, product, version)) or ["node the_node (FancyOp): not supported"])
    monkeypatch.setattr(tensorrt, "build_plan", lambda *a, **k: pytest.fail("build_plan ran before the check"))
    model = make_tiny_model("llama", tmp_path / "hf")
    with pytest.raises(BuildConfigError, match=r"the_node \(FancyOp\)"):
        build.build_engine(BuildConfig(model, tmp_path / "engine", target="tensorrt-rtx", max_seq_len=64))
    import tensorrt_rtx

    assert seen == [("graph.onnx", "tensorrt-rtx", tensorrt_rtx.__version__)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
