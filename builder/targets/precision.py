"""Which precisions each GPU architecture has, per TensorRT product: a quantized build for an architecture that lacks
one of its precisions is refused before any work (quantization included).

Sources (as data, not probed: no GPU here):
  tensorrt-rtx: the "Hardware and Precision" table of the TensorRT-RTX 1.x support matrix (docs.nvidia.com,
      deeplearning/tensorrt-rtx/latest/getting-started/support-matrix.html): FP8 on 8.9 and 12.x only; INT8 and INT4
      weight-only GEMMs and BF16 on 8.6 and later, not on Turing (7.5). sm80 is not in that table; it is Ampere, like
      8.6, and is given Ampere's row. W8A8 INT8 is not in the table; tensorrt-rtx 1.7.1 builds it for sm75, so it is
      allowed everywhere. tensorrt-rtx's own builder agrees where it refuses (fp8 below sm89, int4 on sm75: "the
      model contains HW-specific datatypes"), but only after parsing and optimising the whole graph.
  tensorrt: the TensorRT 10 support matrix (FP8 on 8.9+, BF16 on 8.0+, INT8 on every supported GPU, 7.5+) and the
      Model Optimizer support matrix for the ModelOpt formats (INT4/INT8 weight-only: Ampere and later). W4A8 is in
      neither for TensorRT (ModelOpt lists it for TensorRT-LLM only): its graph composes INT4 weight-only
      DequantizeLinear with FP8 Q/DQ, so it needs both precisions (Ada and later); unverified on datacenter TensorRT.
"""

from __future__ import annotations

from camshaft.errors import BuildConfigError

# Every quant_algo the TensorRT targets build, with the precisions it needs.
ALGO_FEATURES: dict[str, tuple[str, ...]] = {
    "FP8": ("fp8",),
    "W4A8_AWQ": ("int4_weight_only", "fp8"),
    "W8A8_SQ_PER_CHANNEL": ("int8",),
    "W8A16": ("int8_weight_only",),
    "W4A16_AWQ": ("int4_weight_only",),
}
DTYPE_FEATURES = {"bfloat16": "bf16"}

# Lowest compute capability (89 = SM 8.9) with each feature.
MIN_ARCH: dict[str, dict[str, int]] = {
    "tensorrt-rtx": {"fp8": 89, "bf16": 80, "int8": 75, "int8_weight_only": 80, "int4_weight_only": 80},
    "tensorrt": {"fp8": 89, "bf16": 80, "int8": 75, "int8_weight_only": 80, "int4_weight_only": 80},
}
FEATURE_NAMES = {"fp8": "FP8", "bf16": "BF16", "int8": "INT8 (W8A8)", "int8_weight_only": "INT8 weight-only GEMM",
                 "int4_weight_only": "INT4 weight-only (blocked) GEMM"}
# Architectures each product builds for (tensorrt-rtx: its ComputeCapability enum, checked by a test).
PRODUCT_ARCHS = {"tensorrt-rtx": [75, 80, 86, 89, 120, 121], "tensorrt": [75, 80, 86, 87, 89, 90, 100, 103, 110, 120,
                                                                          121]}
ARCH_NAMES = {75: "Turing", 80: "Ampere", 86: "Ampere", 87: "Ampere", 89: "Ada", 90: "Hopper", 100: "Blackwell",
              103: "Blackwell", 110: "Blackwell", 120: "Blackwell", 121: "Blackwell"}


def required_arch(product: str, quant_algo: str | None = None, dtype: str | None = None) -> tuple[int, str | None]:
    """(lowest compute capability that has every precision the build needs, the feature that sets it)."""
    features = list(ALGO_FEATURES.get(quant_algo, ())) if quant_algo else []
    if dtype in DTYPE_FEATURES:
        features.append(DTYPE_FEATURES[dtype])
    table = MIN_ARCH[product]
    best = (0, None)
    for feature in features:
        if table[feature] > best[0]:
            best = (table[feature], feature)
    return best


def check_precision(product: str, arch: int, quant_algo: str | None = None, dtype: str | None = None,
                    shown_as: str | None = None) -> None:
    """Refuse a quantized format (or base dtype) the architecture has no kernels for, naming the ones that have
    (`shown_as`: the format's name in the message, default quant_algo)."""
    need, feature = required_arch(product, quant_algo, dtype)
    if feature is None or arch >= need:
        return
    by_format = bool(quant_algo and feature in ALGO_FEATURES.get(quant_algo, ()))
    what = (shown_as or quant_algo) if by_format else dtype
    able = [a for a in PRODUCT_ARCHS[product] if a >= need]
    names = ", ".join(f"sm{a}" for a in able) or f"sm{need} and later"
    raise BuildConfigError(
        f"sm{arch} ({ARCH_NAMES.get(arch, 'this GPU')}) has no {FEATURE_NAMES[feature]} kernels in {product}, which "
        f"{what} needs; {product} builds it for {names}: {_other_gpu(product, able[0] if able else need)}, or "
        + (f"choose a format this GPU supports ({supported_formats_text(product, arch)})." if by_format
           else "build float16 (--dtype float16).")
    )


def _other_gpu(product: str, arch: int) -> str:
    """How to target a GPU of architecture `arch` or later instead: tensorrt builds for the GPU it runs on."""
    if product == "tensorrt":
        return f"build on a GPU that has them (sm{arch} or later: --target tensorrt builds for the GPU it runs on)"
    return f"pass --gpu-arch sm{arch} for a GPU that has them"


LM_HEAD_FEATURES = {"int8": "int8_weight_only", "int4": "int4_weight_only"}  # --lm-head: a weight-only GEMM


def check_lm_head(product: str, arch: int, lm_head: str, fix: str) -> None:
    """Refuse a quantized lm_head (`camshaft quantize --lm-head`) the architecture has no weight-only kernels for;
    `fix`: how to keep the head float where the user is (before quantizing, or with a checkpoint quantized so)."""
    feature = LM_HEAD_FEATURES.get(lm_head)
    if feature is None or arch >= MIN_ARCH[product][feature]:
        return
    need = MIN_ARCH[product][feature]
    raise BuildConfigError(
        f"sm{arch} ({ARCH_NAMES.get(arch, 'this GPU')}) has no {FEATURE_NAMES[feature]} kernels in {product}, which "
        f"--lm-head {lm_head} needs; {fix}, or {_other_gpu(product, need)}")


def supported_formats_text(product: str, arch: int) -> str:
    from camshaft.quantize.spec import FORMATS

    ok = [name for name, info in FORMATS.items()
          if all(a in ALGO_FEATURES and required_arch(product, a)[0] <= arch for a in info.layer_algos)]
    return "--quant " + " | ".join(ok) if ok else "float16 only: drop --quant"


def graph_features(model) -> dict[str, str]:
    """The precision features an ONNX graph uses, each with the first node that uses it: FP8 or BF16 anywhere, INT4
    anywhere (camshaft's INT4 is always weight-only), INT8 activations (a QuantizeLinear to INT8: W8A8) and INT8
    weight-only GEMMs (a MatMul/Gemm with exactly one operand from an INT8 DequantizeLinear)."""
    from onnx import TensorProto

    from camshaft.builder.targets.trt_support import _load, _value_types

    model = _load(model)
    types = {name: elem for name, (elem, _) in _value_types(model).items()}
    by_type = {TensorProto.FLOAT8E4M3FN: "fp8", TensorProto.BFLOAT16: "bf16", TensorProto.INT4: "int4_weight_only"}
    producer = {out: node for node in model.graph.node for out in node.output}
    found: dict[str, str] = {}
    for index, node in enumerate(model.graph.node):
        name = f"{node.name or f'#{index}'} ({node.op_type})"
        for value in [*node.input, *node.output]:
            feature = by_type.get(types.get(value, 0))
            if feature:
                found.setdefault(feature, name)
        if node.op_type == "QuantizeLinear" and types.get(node.output[0]) == TensorProto.INT8:
            found.setdefault("int8", name)
        if node.op_type in ("MatMul", "Gemm"):
            operands = [producer.get(i) for i in node.input[:2]]
            dqs = [p for p in operands if p is not None and p.op_type == "DequantizeLinear"]
            if len(dqs) == 1 and types.get(dqs[0].input[0]) == TensorProto.INT8:
                found.setdefault("int8_weight_only", name)
    return found


def graph_problems(model, product: str, arch: int) -> list[str]:
    """A line per precision the graph uses that `arch` lacks in `product`, naming the first node that uses it."""
    table = MIN_ARCH[product]
    return [f"node {node}: uses {FEATURE_NAMES[feature]}, which sm{arch} ({ARCH_NAMES.get(arch, 'this GPU')}) lacks "
            f"in {product}; it needs sm{table[feature]} or later"
            for feature, node in graph_features(model).items() if arch < table[feature]]
