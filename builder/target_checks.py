"""Checks that refuse a build before any work: a target that cannot take the checkpoint's format, a missing
TensorRT product or an unsupported GPU architecture, an option that does not apply (`camshaft build --quant` runs
them before calibrating, build_engine before lowering)."""

from __future__ import annotations

from collections.abc import Sequence

from camshaft.builder.checkpoint import READABLE_QUANT_ALGOS
from camshaft.builder.config import FLOAT16_OVERFLOWS, BuildConfig
from camshaft.builder.targets.precision import ALGO_FEATURES
from camshaft.errors import BuildConfigError
from camshaft.model_config import ModelConfig

TRT_QUANT_ALGOS = tuple(ALGO_FEATURES)


def check_quantized_target(target: str, quant_algo: str | None, kv_cache_quant_algo: str | None = None,
                           gpu_arch: str | None = None, shown_as: str | None = None) -> None:
    """Refuse a quantized checkpoint the target cannot build, before any work (`camshaft build --quant` calls it
    before quantizing). The TensorRT targets get every format but fp8_pc_pt and int8_sq_pt (per-token scales,
    computed at run time) as standard Q/DQ (plans built with tensorrt-rtx 1.7, tests/test_quantize_trt.py); a
    quantized KV cache is refused (its float8 pool is uint8 codes, which TensorRT rejects); so is a format whose
    precision `gpu_arch` has no kernels for (fp8 before sm89: targets/precision.py). `shown_as`: the format's name
    in messages (the user's --quant; default the checkpoint's quant_algo). quant_algo None: float layers (a
    checkpoint that quantizes its KV cache only)."""
    if quant_algo is not None and quant_algo not in READABLE_QUANT_ALGOS:
        raise BuildConfigError(f"camshaft cannot build {quant_algo} checkpoints; it builds "
                               f"{', '.join(READABLE_QUANT_ALGOS)}")
    if target == "onnxruntime":
        return
    if (quant_algo is not None and quant_algo not in TRT_QUANT_ALGOS) or kv_cache_quant_algo:
        from camshaft.quantize.spec import FORMATS

        if quant_algo is not None and quant_algo not in TRT_QUANT_ALGOS:
            what = shown_as or f"{quant_algo} checkpoints"
            why = "the inputs take per-token scales, computed at run time (static Q/DQ cannot)"
        else:  # the layers build; the cache does not
            what = f"a KV cache in {kv_cache_quant_algo.lower()}" + (f" (with {shown_as})" if shown_as else "")
            why = ("camshaft lowers quantized KV caches for onnxruntime only" + (
                "; TensorRT rejects the float8 pool's uint8 codes" if "FP8" in kv_cache_quant_algo.upper() else ""))
        builds = [name for name, info in FORMATS.items() if set(info.layer_algos) <= set(TRT_QUANT_ALGOS)]
        raise BuildConfigError(
            f"the {target} target cannot build {what}: {why}. It builds --quant {' | '.join(builds)} without "
            "--kv-cache-dtype; build this one for --target onnxruntime."
        )
    if gpu_arch is not None:
        from camshaft.builder.targets.precision import check_precision
        from camshaft.builder.targets.trt_product import parse_arch

        check_precision(target, parse_arch(gpu_arch), quant_algo, shown_as=shown_as)


def has_weight_only_layers(quant_algos: Sequence[str]) -> bool:
    return any(READABLE_QUANT_ALGOS[algo].activation is None for algo in quant_algos)


def check_weight_only_compute(weight_only_compute: str, quant_algos: Sequence[str], source: str) -> None:
    """Refuse an explicit --weight-only-compute for a checkpoint without weight-only layers (before any work)."""
    if weight_only_compute != "auto" and not has_weight_only_layers(quant_algos):
        raise BuildConfigError(
            "--weight-only-compute applies to weight-only checkpoints (int8_wo, int4_wo, int4_awq; int8_sq_mixed's "
            f"down_proj); {source} is {' + '.join(quant_algos) or 'not quantized'}. Drop it.")


def check_model_target(target: str, model: ModelConfig, quantized: bool) -> None:
    """Refuse, before any work, a model whose graph a TensorRT target cannot parse (its attention has no softcap, and
    it has no mixture-of-experts operator), and a quantized mixture of experts (its experts are lowered float)."""
    if model.moe_layers and target != "onnxruntime":
        raise BuildConfigError(f"{model.architecture}'s mixture of experts runs on ONNX Runtime's MoE operator, which "
                               "TensorRT does not take; build it for --target onnxruntime")
    if model.moe_layers and quantized:
        raise BuildConfigError("a quantized mixture of experts is not supported yet; build the float checkpoint")
    if target != "onnxruntime" and model.attn_softcap is not None:
        raise BuildConfigError(f"{model.architecture} caps its attention scores (attn_logit_softcapping "
                               f"{model.attn_softcap:g}), which TensorRT's attention does not take; build it for "
                               "--target onnxruntime")


def check_model_dtype(model: ModelConfig, dtype: str) -> None:
    """Refuse a float16 engine of a model whose activations overflow float16 (every logit NaN), before any work."""
    if dtype == "float16" and model.architecture in FLOAT16_OVERFLOWS:
        raise BuildConfigError(f"{model.architecture}'s activations exceed float16's range (65504; its engine would "
                               "give NaN; vLLM refuses float16 for Gemma too); build it in bfloat16 (--dtype "
                               "bfloat16, a GPU of sm80 or newer) or for --target onnxruntime (float32)")


def check_lm_head_target(target: str, lm_head: str, gpu_arch: str | None, fix: str) -> None:
    """Refuse a quantized lm_head that `gpu_arch` (check_target's) has no weight-only kernels for, before any work;
    `fix` says how to keep it float where the user is."""
    if gpu_arch is None or lm_head == "float":
        return
    from camshaft.builder.targets.precision import check_lm_head
    from camshaft.builder.targets.trt_product import parse_arch

    check_lm_head(target, parse_arch(gpu_arch), lm_head, fix)


def check_target(config: BuildConfig) -> str | None:
    """Refuse a target whose product is missing or cannot build for the architecture, before any work (`camshaft
    build --quant` calls it before calibrating). Returns the GPU architecture the plan is built for (the tensorrt
    target without --gpu-arch: the local GPU's); None for onnxruntime."""
    if not config.target.startswith("tensorrt"):
        return None
    from camshaft.builder.targets import trt_product

    trt = trt_product.import_product(config.target)
    if config.resolved_gpu_arch is None:  # BuildConfig checked the dtype against an explicit --gpu-arch only
        from camshaft.builder.targets.precision import check_precision

        arch = trt_product.supported_archs(trt, config.target)[0]
        check_precision(config.target, arch, dtype=config.resolved_dtype())
        return f"sm{arch}"
    trt_product.check_arch(trt, config.target, config.resolved_gpu_arch)
    return config.resolved_gpu_arch
