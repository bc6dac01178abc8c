"""The static check (TensorRT's ONNX operator matrix + the precisions each GPU architecture has) on the TensorRT-lowered
graph of every format, for every architecture each product builds for; a quantized graph with an unsupported operator
fails it. No TensorRT needed: this is the check that runs before any parser or builder."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import helper

from camshaft.builder.build import write_graph
from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.targets.precision import (
    ALGO_FEATURES,
    PRODUCT_ARCHS,
    graph_features,
    graph_problems,
    required_arch,
)
from camshaft.builder.targets.trt_support import check_graph, require_supported
from camshaft.errors import BuildConfigError
from camshaft.manifest import BuildLimits
from camshaft.quantize.spec import FORMATS

from tiny_models import make_tiny_model

pytest.importorskip("modelopt.torch.quantization")

LIMITS = BuildLimits(max_batch_size=4, max_seq_len=64, max_num_tokens=16, kv_block_size=4)
TRT_FORMATS = sorted(name for name, info in FORMATS.items()  # (not the per-token formats)
                     if all(algo in ALGO_FEATURES for algo in info.layer_algos))
CASES = ["fp16", *TRT_FORMATS, "int8_wo+head-int4", "fp8+head-int8"]
VERSIONS = {"tensorrt-rtx": None, "tensorrt": "10.15"}


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> dict[str, Path]:
    """The TensorRT (Q/DQ) graph of a tiny llama in every format, plus quantized lm_heads."""
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    root = tmp_path_factory.mktemp("fmts")
    tiny = make_tiny_model("llama", root / "hf")
    out = {}
    for case in CASES:
        source = tiny
        if case != "fp16":
            fmt, _, head = case.partition("+head-")
            source = root / f"{case}.ckpt"
            quantize_checkpoint(tiny, source, QuantSpec(fmt, lm_head=head or "float"), calib_size=2, calib_seq_len=32)
        (root / case).mkdir()
        with Checkpoint(source) as checkpoint:
            out[case] = write_graph(checkpoint, LIMITS, "float16", root / case, qdq=True)
    return out


def _algos(case: str) -> list[str | None]:
    """The checkpoint algorithms whose precisions the case's graph uses (a quantized head is weight-only)."""
    fmt, _, head = case.partition("+head-")
    return [*(FORMATS[fmt].layer_algos if fmt in FORMATS else [None])] + ([FORMATS[f"{head}_wo"].checkpoint_algo]
                                                                          if head else [])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("product", sorted(PRODUCT_ARCHS))
def test_every_format_passes_the_matrix_for_every_arch_that_has_its_precision(graphs, case, product) -> None:
    graph = onnx.load(str(graphs[case]), load_external_data=False)
    onnx.checker.check_model(str(graphs[case]))
    assert check_graph(graph, product, VERSIONS[product]) == []
    need = max(required_arch(product, algo)[0] for algo in _algos(case))
    for arch in PRODUCT_ARCHS[product]:
        problems = graph_problems(graph, product, arch)
        assert (problems == []) == (arch >= need), (arch, problems)
        if arch >= need:
            require_supported(graph, product, VERSIONS[product], gpu_arch=arch)
        else:
            with pytest.raises(BuildConfigError, match=rf"lacks in {product}"):
                require_supported(graph, product, VERSIONS[product], gpu_arch=arch)


@pytest.mark.parametrize("case", CASES)
def test_graph_precisions_match_the_format(graphs, case) -> None:
    """What the graph itself uses is what the format's table entry says (the check before quantizing relies on it)."""
    features = set(graph_features(graphs[case]))
    expected = {feature for algo in _algos(case) for feature in ALGO_FEATURES.get(algo, ())}
    assert features == expected


def test_quantized_graph_with_an_unsupported_operator_fails(graphs) -> None:
    graph = onnx.load(str(graphs["int4_awq"]), load_external_data=False)
    logits = graph.graph.output[0].name
    node = next(n for n in graph.graph.node if logits in n.output)
    node.output[0] = "pre_logits"
    graph.graph.node.append(helper.make_node("MatMulInteger", ["pre_logits", "pre_logits"], [logits],
                                             name="the_bad_node"))
    for product in PRODUCT_ARCHS:
        problems = check_graph(graph, product, VERSIONS[product])
        assert [p for p in problems if "the_bad_node (MatMulInteger)" in p], problems
        with pytest.raises(BuildConfigError, match=r"the_bad_node \(MatMulInteger\)"):
            require_supported(graph, product, VERSIONS[product], gpu_arch=89)
