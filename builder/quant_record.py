"""The manifest's record of a quantized build: formats, lowering, what stayed float, calibration."""

from __future__ import annotations

import re

from camshaft.builder.checkpoint import MIXED, READABLE_QUANT_ALGOS
from camshaft.builder.graph.decoder import DecoderLowering
from camshaft.builder.graph.linear import LOWERINGS
from camshaft.builder.quantized import KV_CACHE_ALGOS

KV_FLAG_DTYPES = {element: algo.lower() for algo, element in KV_CACHE_ALGOS.items()}  # float8 -> --kv-cache-dtype fp8


def quantization_record(quant: dict, algos: list[str], lowering: DecoderLowering) -> dict:
    """The manifest's record of a quantized checkpoint. Policy: lm_head stays float (ModelOpt leaves it unquantized)
    unless `--lm-head int8|int4` rounded it at build time or the checkpoint quantized it (then lowered as its other
    layers); the embedding stays float, except that a tied one reads a quantized head's tensors (onnxruntime target);
    a quantized layer no kernel expresses is built from its dequantized weights."""
    record = quant.get("camshaft", {})
    counts = lowering.linears.counts
    formats = [READABLE_QUANT_ALGOS[a] for a in algos]
    activation = "; ".join(sorted({f"{f.activation} {'dynamic per-token' if f.per_token else 'static per-tensor'}"
                                   for f in formats if f.activation}))
    level = lowering.linears.accuracy_level if counts["nbits"] else None
    int8_blocks = "int8 dynamic per block (MatMulNBits accuracy level 4)" if level == 4 else None
    algo = quant.get("quant_algo")  # None: float layers (a KV cache quantized alone)
    head, floats = lowering.head, set(lowering.linears.floats)
    if head.record["dtype"] == "float" and "lm_head" not in lowering.linears.dequantized:
        floats.add("lm_head")
    if not head.shares_embedding:
        floats.add("model.embed_tokens")
    return {
        "format": record.get("format"),
        "quant_algo": algo,
        **({"layer_quant_algos": algos} if algo == MIXED else {}),
        "group_size": quant.get("group_size"),
        # in --kv-cache-dtype's words (fp8 | int8); kv_cache.dtype names the pool's element (float8 | int8)
        "kv_cache_dtype": KV_FLAG_DTYPES.get(lowering.kv.dtype) if lowering.kv_quant is not None else None,
        "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
        "kv_cache_affine": lowering.kv_quant is not None and bool(lowering.kv_quant.biases),
        "activations": "; ".join(a for a in (activation, int8_blocks) if a) or None,
        "lowering": " + ".join(LOWERINGS[kind] for kind in sorted(counts)) or None,
        "accuracy_level": level,
        "quantized_linear_layers": sum(counts.values()),
        "dequantized_linear_layers": lowering.linears.dequantized,  # quantized, but built float (exact)
        "float_modules": every_layer_as_star(floats, lowering.c.num_layers),
        "lm_head": lowering.head.record,
        "algorithm": record.get("algorithm"),  # ModelOpt's calibration algorithm, e.g. SmoothQuant's alpha
        "calibration": record.get("calibration"),
        "producer": quant.get("producer") or record.get("tools"),
    }


def every_layer_as_star(modules: set[str], num_layers: int) -> list[str]:
    """The module names, sorted, with model.layers.*.NAME for a NAME every layer has."""
    names, layers = set(), {}
    for module in modules:
        if match := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module):
            layers.setdefault(match[2], set()).add(match[1])
        else:
            names.add(module)
    for name, found in layers.items():
        names |= {f"model.layers.*.{name}"} if len(found) == num_layers else {f"model.layers.{i}.{name}" for i in found}
    return sorted(names)
