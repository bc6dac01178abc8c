"""The TensorRT targets: the model graph compiled into a serialized TensorRT plan.

One adapter serves both products:
  "tensorrt-rtx" (module `tensorrt_rtx`): builds ahead of time on a machine without a GPU, for the compute
      capability the caller names (`IBuilderConfig.num_compute_capabilities` + `set_compute_capability`);
  "tensorrt" (module `tensorrt`, the datacenter product): builds for the GPU it runs on, which must be the target.
Both networks are strongly typed: precision comes from the graph's dtypes (build the float16 graph), not from
builder flags. The product is imported inside functions only, so camshaft imports without it.

The plan holds one optimisation profile covering every dynamic input dimension of the graph (see `profile_ranges`).
Every group is at least one row: a step without decode tokens still passes one padding decode row (and likewise for
prefill), as the onnxruntime target's runtime does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from camshaft.builder.targets.trt_product import check_arch, import_product
from camshaft.engine_files import write_atomic
from camshaft.errors import BuildConfigError
from camshaft.manifest import BuildLimits
from camshaft.trt_logger import Stop, build_monitor, capturing_logger, quoted

Progress = Callable[[str], None]

ARTIFACT = "model.plan"


def profile_ranges(limits: BuildLimits, num_blocks_max: int) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every symbolic graph dimension.

    opt favours the steady state of serving: a full decode batch with half-length contexts, one prefill chunk
    filling the step's token budget.
    """
    if num_blocks_max < 2:
        raise BuildConfigError(f"num_blocks_max must be at least 2 (block 0 is the null block), not {num_blocks_max}")
    tokens, bs = limits.max_num_tokens, limits.kv_block_size
    batch = min(limits.max_batch_size, tokens)  # a step's rows: each takes a token of its budget
    blocks = limits.max_blocks_per_seq
    query = min(tokens, limits.max_seq_len)
    decode_blocks = max(1, blocks // 2)
    prefill_blocks = min(blocks, -(-query // bs))
    return {
        "T": (1, tokens, tokens),
        "N": (1, batch, tokens),
        "Bd": (1, batch, batch),
        "NBd": (1, decode_blocks, blocks),
        "Ld": (bs, decode_blocks * bs, blocks * bs),
        "Bp": (1, 1, batch),
        "Qp": (1, query, query),
        "NBp": (1, prefill_blocks, blocks),
        "Lp": (bs, prefill_blocks * bs, blocks * bs),
        "num_blocks": (2, num_blocks_max, num_blocks_max),
    }


def _input_dims(graph_path: Path) -> dict[str, list[int | str]]:
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    dims = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims[value.name] = [d.dim_param if d.HasField("dim_param") else d.dim_value
                            for d in value.type.tensor_type.shape.dim]
    return dims


def _shapes(dims: list[int | str], ranges: dict[str, tuple[int, int, int]], name: str) -> tuple[list[int], ...]:
    out: tuple[list[int], ...] = ([], [], [])
    for d in dims:
        if isinstance(d, int) and d > 0:
            lo = opt = hi = d
        elif d in ranges:
            lo, opt, hi = ranges[d]
        else:
            raise BuildConfigError(
                f"graph input {name} has a dimension {d!r} the TensorRT target has no range for; the graph and the "
                "target are out of step (a camshaft bug)"
            )
        for shape, value in zip(out, (lo, opt, hi), strict=True):
            shape.append(value)
    return out


def build_plan(graph_path: Path, plan_path: Path, *, product: str, gpu_arch: str, limits: BuildLimits,
               num_blocks_max: int, progress: Progress = lambda _: None) -> dict[str, object]:
    """Compile an ONNX graph (with external data beside it) into a TensorRT plan written atomically at plan_path."""
    graph_path, plan_path = Path(graph_path), Path(plan_path)
    trt = import_product(product)
    arch = check_arch(trt, product, gpu_arch)
    ranges = profile_ranges(limits, num_blocks_max)
    if not graph_path.is_file():
        raise BuildConfigError(f"model graph {graph_path} does not exist")
    input_dims = _input_dims(graph_path)
    started = time.perf_counter()

    messages: list[str] = []
    stop = Stop()
    logger = capturing_logger(trt, messages, progress, stop)
    builder = trt.Builder(logger)
    flag = trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED
    network = builder.create_network(1 << int(flag))
    parser = trt.OnnxParser(network, logger)
    progress(f"parsing {graph_path.name} with {product} {trt.__version__}")
    if not parser.parse_from_file(str(graph_path)):
        errors = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            errors.append(f"  node {e.node()} {e.node_name() or '?'} ({e.node_operator() or '?'}): {e.desc()}")
        raise BuildConfigError(
            f"{product} {trt.__version__} cannot parse the model graph {graph_path} "
            f"({parser.num_errors} error(s)):\n" + "\n".join(errors or messages or ["  (no details)"])
            + "\nWhere the errors name an operator, this model cannot be built for this target: build it for the "
            "onnxruntime target."
        )

    config = builder.create_builder_config()
    if product == "tensorrt-rtx":
        config.num_compute_capabilities = 1
        if not config.set_compute_capability(getattr(trt.ComputeCapability, f"SM{arch}"), 0):
            raise BuildConfigError(f"{product} refused compute capability sm{arch}")

    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        dims = input_dims.get(tensor.name)
        if dims is None:
            raise BuildConfigError(f"{product} sees a graph input {tensor.name} that the ONNX graph does not list")
        lo, opt, hi = _shapes(dims, ranges, tensor.name)
        profile.set_shape(tensor.name, lo, opt, hi)
    config.add_optimization_profile(profile)

    progress(f"building the {product} plan for sm{arch}")
    monitor = build_monitor(trt, progress, stop)
    config.progress_monitor = monitor
    with stop.deferring_signals():
        plan = builder.build_serialized_network(network, config)
    stop.raise_kept()  # Ctrl-C or SIGTERM during the build: it was cancelled, nothing is written
    if plan is None or plan.nbytes == 0:
        detail = quoted(messages[-20:])
        raise BuildConfigError(f"{product} {trt.__version__} failed to build a plan for sm{arch}:\n{detail}")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(plan_path, memoryview(plan))
    seconds = time.perf_counter() - started
    progress(f"{product} plan: {plan.nbytes / 2**20:.1f} MiB in {seconds:.1f} s")
    return {
        "product": product,
        "version": trt.__version__,
        "gpu_arch": f"sm{arch}",
        "plan_bytes": plan.nbytes,
        "build_seconds": round(seconds, 2),
        "profile": {name: list(r) for name, r in ranges.items()},
    }
