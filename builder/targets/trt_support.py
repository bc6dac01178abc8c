"""Static check of an ONNX graph against TensorRT's published ONNX operator support matrix, before any build.

The matrix lives as data in `tensorrt_onnx_ops.json` (operator → supported element types, restrictions, the TensorRT
version that added it), transcribed from the ONNX-TensorRT "Supported ONNX Operators" page of TensorRT 10.15 with its
source named in the file. TensorRT-RTX publishes no matrix of its own; its parser is TensorRT 10.x's, so the same
matrix applies with the differences camshaft observed (`product_overrides`).

What is checked, per node: the domain (standard ONNX only: no contrib or custom domains, no plugins), that the
operator is in the matrix and supported, that the element type of its typed inputs is listed, the opset, and the
restrictions that can be checked statically for the operators camshaft emits (Attention, RotaryEmbedding, ScatterND,
TensorScatter, Squeeze/Unsqueeze axes, Cast targets). Passing is necessary, not sufficient: the parser and the
builder still decide (see targets/tensorrt.py).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import onnx
from onnx import TensorProto

from camshaft.errors import BuildConfigError

MATRIX_PATH = Path(__file__).with_name("tensorrt_onnx_ops.json")

TYPE_NAMES = {
    TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
    TensorProto.DOUBLE: "DOUBLE", TensorProto.INT32: "INT32", TensorProto.INT64: "INT64", TensorProto.INT8: "INT8",
    TensorProto.UINT8: "UINT8", TensorProto.BOOL: "BOOL", TensorProto.INT4: "INT4",
    TensorProto.FLOAT8E4M3FN: "FP8", TensorProto.FLOAT4E2M1: "FP4",
}

# Which inputs carry the operator's type (the matrix's "Supported Types"); other inputs are indices, shapes, axes.
# Default: input 0. "all": every non-empty input.
TYPED_INPUTS: dict[str, tuple[int, ...] | str] = {
    "Concat": "all", "Sum": "all", "Max": "all", "Min": "all", "Mean": "all",
    "Attention": (0, 1, 2),
    "Where": (1, 2),
    "ScatterND": (0, 2), "ScatterElements": (0, 2), "TensorScatter": (0, 1),
}


@cache
def load_matrix() -> dict:
    try:
        return json.loads(MATRIX_PATH.read_text())
    except FileNotFoundError as exc:  # a packaging error, not a user error
        raise BuildConfigError(f"the TensorRT operator matrix {MATRIX_PATH} is missing from this install") from exc


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _operators(product: str) -> dict[str, dict]:
    matrix = load_matrix()
    ops = {name: dict(entry) for name, entry in matrix["operators"].items()}
    for name, change in matrix.get("product_overrides", {}).get(product, {}).get("operators", {}).items():
        ops[name] = {**ops.get(name, {"supported": True}), **change}
    return ops


def _load(model: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    return onnx.load(str(model), load_external_data=False)


def _value_types(model: onnx.ModelProto) -> dict[str, tuple[int, int | None]]:
    """name → (element type, rank or None) for every value, through ONNX shape inference (no weights needed)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=False)
    except Exception:  # inference is a help here, not a requirement: fall back to what the graph declares
        inferred = model
    graph = inferred.graph
    types: dict[str, tuple[int, int | None]] = {}
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        t = value.type.tensor_type
        if t.elem_type:
            types[value.name] = (t.elem_type, len(t.shape.dim) if t.HasField("shape") else None)
    for init in graph.initializer:
        types[init.name] = (init.data_type, len(init.dims))
    return types


def _constant_names(model: onnx.ModelProto) -> set[str]:
    names = {init.name for init in model.graph.initializer}
    names.update(out for node in model.graph.node if node.op_type == "Constant" for out in node.output)
    return names


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _restrictions(node: onnx.NodeProto, types: dict, constants: set[str]) -> list[str]:
    """The matrix's restrictions that can be checked statically, for the operators camshaft emits."""
    op, problems = node.op_type, []
    inputs = list(node.input)

    def present(i: int) -> bool:
        return len(inputs) > i and inputs[i] != ""

    def rank(i: int) -> int | None:
        return types.get(inputs[i], (0, None))[1] if present(i) else None

    if op == "Attention":
        ranks = [rank(i) for i in range(3)]
        if None not in ranks and (len(set(ranks)) != 1 or ranks[0] not in (3, 4)):
            problems.append(f"Q, K and V must all be 3D or all 4D, not ranks {ranks}")
        if ranks[0] == 3 and (_attr(node, "q_num_heads") is None or _attr(node, "kv_num_heads") is None):
            problems.append("3D Q/K/V need the q_num_heads and kv_num_heads attributes")
        if present(3) and rank(3) not in (None, 4):
            problems.append(f"attn_mask must be 4D, not {rank(3)}D")
        for i, what in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")):
            if present(i):
                problems.append(f"the {what} input is unsupported")
        if len([o for o in node.output if o]) != 1 or (len(node.output) > 1 and any(node.output[1:])):
            problems.append("only the first output is supported (no present_key/present_value/qk_matmul_output)")
        if _attr(node, "softcap", 0.0) or _attr(node, "qk_matmul_output_mode", 0):
            problems.append("softcap and qk_matmul_output_mode are unsupported")
    elif op == "RotaryEmbedding":
        if present(3) and types.get(inputs[3], (TensorProto.INT64, None))[0] != TensorProto.INT64:
            problems.append("position_ids must be INT64")
    elif op == "ScatterND":
        if _attr(node, "reduction", b"none") not in (b"none", "none"):
            problems.append("reduction must be none")
    elif op == "TensorScatter":
        if _attr(node, "axis", -2) != -2:
            problems.append("axis must be -2")
        if any(rank(i) not in (None, 4) for i in (0, 1)):
            problems.append("past_cache and update must be 4D")
    elif op in ("Squeeze", "Unsqueeze"):
        if present(1) and inputs[1] not in constants:
            problems.append("axes must be a constant")
    elif op == "Cast":
        target = _attr(node, "to")
        if target is not None and TYPE_NAMES.get(target) not in ("FP32", "FP16", "BF16", "INT32", "INT64", "UINT8",
                                                                 "BOOL"):
            problems.append(f"cast to {TYPE_NAMES.get(target, onnx.TensorProto.DataType.Name(target))} is unsupported")
    return problems


def check_graph(model: onnx.ModelProto | str | Path, product: str = "tensorrt-rtx",
                product_version: str | None = None) -> list[str]:
    """Problems that keep `model` from TensorRT, one line each, naming the node; empty when none are known.

    product: "tensorrt" (datacenter, the published matrix) or "tensorrt-rtx" (the matrix plus observed differences).
    product_version: for "tensorrt", operators added after this version (e.g. RotaryEmbedding before 10.15) fail.
    """
    model = _load(model)
    matrix = load_matrix()
    ops = _operators(product)
    problems: list[str] = []
    low, high = matrix["opset_range"]
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and not low <= opset.version <= high:
            problems.append(f"graph: opset {opset.version} is outside TensorRT {matrix['version']}'s range "
                            f"{low}-{high}")
    types = _value_types(model)
    constants = _constant_names(model)
    version = _version_tuple(product_version) if product_version and product == "tensorrt" else None
    for index, node in enumerate(model.graph.node):
        where = f"node {node.name or f'#{index}'} ({node.op_type})"
        if node.domain not in matrix["domains"]:
            problems.append(f"{where}: domain {node.domain!r} is not standard ONNX; TensorRT parses it only through a "
                            "plugin, which camshaft does not provide")
            continue
        entry = ops.get(node.op_type)
        if entry is None or not entry.get("supported"):
            state = "not in" if entry is None else "marked unsupported in"
            problems.append(f"{where}: the operator is {state} TensorRT's ONNX support matrix")
            continue
        if version is not None and "since" in entry and version < _version_tuple(entry["since"]):
            problems.append(f"{where}: TensorRT parses {node.op_type} only since {entry['since']}, "
                            f"not {product_version}")
        allowed = set(entry.get("types", ()))
        selected = TYPED_INPUTS.get(node.op_type, (0,))
        positions = range(len(node.input)) if selected == "all" else selected
        for i in positions:
            if i >= len(node.input) or not node.input[i] or node.input[i] not in types:
                continue
            elem = types[node.input[i]][0]
            name = TYPE_NAMES.get(elem, TensorProto.DataType.Name(elem))
            if name not in allowed:
                problems.append(f"{where}: input {node.input[i]} is {name}; TensorRT supports {node.op_type} for "
                                f"{', '.join(sorted(allowed)) or 'no type'}")
        problems.extend(f"{where}: {p}" for p in _restrictions(node, types, constants))
    return problems


def require_supported(model: onnx.ModelProto | str | Path, product: str = "tensorrt-rtx",
                      product_version: str | None = None, limit: int = 20, gpu_arch: int | None = None) -> None:
    """check_graph (and, given `gpu_arch`, the precisions that architecture has: precision.graph_problems), raising
    BuildConfigError that lists the problems (at most `limit` of them)."""
    problems = check_graph(model, product, product_version)
    if gpu_arch is not None:
        from camshaft.builder.targets.precision import graph_problems

        problems += graph_problems(model, product, gpu_arch)
    if not problems:
        return
    matrix = load_matrix()
    shown = "\n".join(f"  {p}" for p in problems[:limit])
    more = f"\n  … and {len(problems) - limit} more" if len(problems) > limit else ""
    raise BuildConfigError(
        f"the model graph uses {len(problems)} construct(s) outside TensorRT's ONNX support matrix "
        f"(TensorRT {matrix['version']}, {matrix['source']['path']}) for {product}:\n{shown}{more}\n"
        "This model cannot be built for this target; use the onnxruntime target for it."
    )
