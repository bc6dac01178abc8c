"""A precision the chosen GPU architecture lacks (fp8 before sm89, INT4/INT8 weight-only on Turing) is refused before
any work, naming the architecture and the ones that have it; where tensorrt-rtx's own builder refuses a format for
an architecture, camshaft's table (builder/targets/precision.py) refuses it first."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from camshaft.builder.build import build_engine, write_graph
from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.config import BuildConfig
from camshaft.builder.target_checks import check_quantized_target
from camshaft.builder.targets.precision import PRODUCT_ARCHS, check_precision, required_arch
from camshaft.errors import BuildConfigError
from camshaft.manifest import BuildLimits
from camshaft.quantize.spec import FORMATS

from tiny_models import make_tiny_model

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
NEEDS_RTX = pytest.mark.skipif(not HAS_RTX,
                               reason="tensorrt_rtx is not installed (pip install 'camshaft[tensorrt-rtx]')")
LIMITS = BuildLimits(max_batch_size=4, max_seq_len=64, max_num_tokens=32, kv_block_size=8)
ALGO = {name: info.checkpoint_algo for name, info in FORMATS.items() if len(info.layer_algos) == 1}


@pytest.mark.parametrize("product", ["tensorrt-rtx", "tensorrt"])
@pytest.mark.parametrize("fmt", ["fp8", "w4a8_awq"])
@pytest.mark.parametrize("arch", ["sm86", "sm80", "sm75"])
def test_fp8_before_ada_is_refused(product: str, fmt: str, arch: str) -> None:
    with pytest.raises(BuildConfigError, match=rf"{arch} \(\w+\) has no FP8 kernels in {product}(.|\n)*sm89") as info:
        check_quantized_target(product, ALGO[fmt], gpu_arch=arch)
    advice = ("pass --gpu-arch sm89" if product == "tensorrt-rtx"  # tensorrt builds only for the GPU it runs on
              else "build on a GPU that has them (sm89 or later: --target tensorrt builds for the GPU it runs on)")
    assert advice in str(info.value) and ("--gpu-arch" in str(info.value)) == (product == "tensorrt-rtx")
    check_quantized_target(product, ALGO[fmt], gpu_arch="sm89")
    check_quantized_target(product, ALGO[fmt], gpu_arch="sm120")


def test_turing_lacks_weight_only_gemms_in_tensorrt_rtx() -> None:
    for fmt in ("int4_wo", "int4_awq", "int8_wo"):
        with pytest.raises(BuildConfigError, match=r"sm75 \(Turing\) has no INT\d weight-only") as info:
            check_quantized_target("tensorrt-rtx", ALGO[fmt], gpu_arch="sm75")
        assert "sm80, sm86, sm89, sm120, sm121" in str(info.value) and "--quant int8_sq" in str(info.value)
        check_quantized_target("tensorrt-rtx", ALGO[fmt], gpu_arch="sm86")
    check_quantized_target("tensorrt-rtx", ALGO["int8_sq"], gpu_arch="sm75")
    check_quantized_target("tensorrt", ALGO["int8_sq"], gpu_arch="75")


def test_every_format_builds_for_sm89_and_bf16_needs_ampere() -> None:
    for product in PRODUCT_ARCHS:
        for algo in {a for info in FORMATS.values() for a in info.layer_algos}:
            assert required_arch(product, algo)[0] <= 89
            check_precision(product, 89, algo)
    with pytest.raises(BuildConfigError, match=r"no BF16 kernels(.|\n)*--dtype float16"):
        check_precision("tensorrt-rtx", 75, dtype="bfloat16")
    check_precision("tensorrt", 80, dtype="bfloat16")


@NEEDS_RTX
def test_product_arch_list_is_tensorrt_rtx_own() -> None:
    import tensorrt_rtx

    from camshaft.builder.targets.trt_product import supported_archs

    assert PRODUCT_ARCHS["tensorrt-rtx"] == supported_archs(tensorrt_rtx, "tensorrt-rtx")


def test_bad_arch_spelling_fails_in_build_config(tmp_path: Path) -> None:
    with pytest.raises(BuildConfigError, match="not a GPU architecture"):
        BuildConfig(tmp_path / "hf", tmp_path / "out", target="tensorrt-rtx", gpu_arch="ampere")


def test_bf16_base_precision_in_build_config(tmp_path: Path) -> None:
    config = BuildConfig(tmp_path / "hf", tmp_path / "out", target="tensorrt-rtx", dtype="bfloat16")
    assert config.resolved_dtype() == "bfloat16" and config.resolved_gpu_arch == "sm89"
    with pytest.raises(BuildConfigError, match=r"no BF16 kernels"):
        BuildConfig(tmp_path / "hf", tmp_path / "out", target="tensorrt-rtx", dtype="bfloat16", gpu_arch="sm75")
    with pytest.raises(BuildConfigError, match=r"onnxruntime builds float32 engines, not bfloat16"):
        BuildConfig(tmp_path / "hf", tmp_path / "out", dtype="bfloat16")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, Path]:
    """Tiny llama checkpoints in the formats whose arch limits tensorrt-rtx's builder enforces itself."""
    pytest.importorskip("modelopt.torch.quantization")
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    root = tmp_path_factory.mktemp("prec")
    tiny = make_tiny_model("llama", root / "hf")
    for fmt in ("fp8", "int4_wo", "int8_sq"):
        quantize_checkpoint(tiny, root / fmt, QuantSpec(fmt), calib_size=2, calib_seq_len=32)
    return {fmt: root / fmt for fmt in ("fp8", "int4_wo", "int8_sq")}


@NEEDS_RTX
@pytest.mark.tensorrt
def test_build_engine_refuses_fp8_for_sm86_before_any_work(quantized, tmp_path: Path) -> None:
    out = tmp_path / "engine"
    with pytest.raises(BuildConfigError, match=r"sm86 \(Ampere\) has no FP8 kernels in tensorrt-rtx"):
        build_engine(BuildConfig(quantized["fp8"], out, target="tensorrt-rtx", gpu_arch="sm86", max_seq_len=64))
    assert list(tmp_path.iterdir()) == []


@NEEDS_RTX
@pytest.mark.tensorrt
def test_build_engine_refuses_a_quantized_head_for_sm75_before_any_work(tmp_path: Path) -> None:
    pytest.importorskip("modelopt.torch.quantization")
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    checkpoint = tmp_path / "int8_sq-head4"
    quantize_checkpoint(make_tiny_model("llama", tmp_path / "hf"), checkpoint, QuantSpec("int8_sq", lm_head="int4"),
                        calib_size=2, calib_seq_len=32)
    with pytest.raises(BuildConfigError, match=r"sm75 \(Turing\) has no INT4 weight-only .* which --lm-head int4 "
                                               r"needs; quantize the checkpoint again with --lm-head float"):
        build_engine(BuildConfig(checkpoint, tmp_path / "engine", target="tensorrt-rtx", gpu_arch="sm75",
                                 max_seq_len=64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "int8_sq-head4"]


@NEEDS_RTX
@pytest.mark.tensorrt
@pytest.mark.parametrize("fmt", ["fp8", "int4_wo", "int8_sq"])
def test_table_refuses_whatever_the_builder_refuses(quantized, tmp_path: Path, fmt: str) -> None:
    """Bypass the table and ask tensorrt-rtx itself, for each architecture below sm89."""
    from camshaft.builder.targets.tensorrt import build_plan

    with Checkpoint(quantized[fmt]) as checkpoint:
        graph = write_graph(checkpoint, LIMITS, "float16", tmp_path, qdq=True)
    for arch in (75, 86):
        try:
            build_plan(graph, tmp_path / f"sm{arch}.plan", product="tensorrt-rtx", gpu_arch=f"sm{arch}",
                       limits=LIMITS, num_blocks_max=33)
        except BuildConfigError as exc:
            assert "HW-specific datatypes" in str(exc)
            with pytest.raises(BuildConfigError, match=f"sm{arch}"):
                check_precision("tensorrt-rtx", arch, ALGO[fmt])
    expected = {"fp8": {75, 86}, "int4_wo": {75}, "int8_sq": set()}[fmt]
    assert {a for a in (75, 86) if not (tmp_path / f"sm{a}.plan").is_file()} == expected


@NEEDS_RTX
@pytest.mark.tensorrt
@pytest.mark.parametrize("fmt", ["fp8", "int4_wo", "int8_sq"])
def test_tiny_quantized_plan_is_built_from_its_own_graph(quantized, tmp_path: Path, fmt: str) -> None:
    import tensorrt_rtx

    from camshaft.builder.build import GRAPH_NAME, file_sha256
    from camshaft.manifest import read_manifest

    out = tmp_path / "engine"
    build_engine(BuildConfig(quantized[fmt], out, target="tensorrt-rtx", gpu_arch="sm89", max_seq_len=64,
                             max_batch_size=4, max_num_tokens=32, kv_block_size=8))
    manifest = read_manifest(out)
    assert manifest.graph_sha256 == file_sha256(out / GRAPH_NAME)
    assert manifest.quantization["format"] == fmt
    options = manifest.target_options
    assert (options["product"], options["version"], options["gpu_arch"]) == ("tensorrt-rtx", tensorrt_rtx.__version__,
                                                                             "sm89")
    assert options["plan_bytes"] == (out / "model.plan").stat().st_size
