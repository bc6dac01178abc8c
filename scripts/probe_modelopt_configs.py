#!/usr/bin/env python
"""Perplexity of ModelOpt quantization configs on SmolLM2, as fake-quant models in transformers (no engine build).

A quick way to see what a config would cost before wiring it into camshaft: the KV cache quantizers per-tensor vs
affine (the bias camshaft adopted), FP8 per-channel/per-token, INT8 with per-token dynamic activations. Same held-out
text and calibration corpus as scripts/bench_quant_accuracy.sh (run that first for out/q/heldout.txt).

    .venv/bin/python scripts/probe_modelopt_configs.py kv_fp8 kv_fp8_affine kv_int8 kv_int8_affine fp8_pc_pt int8_pt
    .venv/bin/python scripts/probe_modelopt_configs.py fp8 fp8_pc_pt int8_sq --each-layer

`--each-layer` also leaves one part of the model float at a time (each decoder layer's linear layers, each
projection across all layers, the last layer's MLP and its down_proj) and reports the held-out text and a validation
text (the first 6000 bytes of IDLE's HISTORY.txt, as scripts/sweep_smoothquant.py): is a format's loss concentrated
where `--exclude` could take it out?
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_quant import FakeQuantBench, validation_text  # noqa: E402

KV = "*[kv]_bmm_quantizer"
AFFINE = {"bias": {-2: None, -4: None, "type": "static"}}
PER_TOKEN = {"type": "dynamic", "block_sizes": {-1: None}}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def configs() -> dict[str, dict]:
    import modelopt.torch.quantization as mtq

    def kv_only(cfg: dict) -> dict:
        return {"quant_cfg": [{"quantizer_name": "*", "enable": False}, {"quantizer_name": KV, "cfg": cfg}],
                "algorithm": "max"}

    def only(cfg: dict, disabled: str) -> dict:
        """`cfg` with the quantizers matching `disabled` left float."""
        out = copy.deepcopy(cfg)
        out["quant_cfg"] = [*out["quant_cfg"], {"quantizer_name": disabled, "enable": False}]
        return out

    def per_channel_weights(cfg: dict) -> dict:
        """`cfg` with a scale per output channel for every weight (FP8_PER_CHANNEL_PER_TOKEN_CFG's weights)."""
        out = copy.deepcopy(cfg)
        out["quant_cfg"] = [{**e, "cfg": {**e["cfg"], "axis": 0}} if e.get("quantizer_name") == "*weight_quantizer"
                            else e for e in out["quant_cfg"]]
        return out

    int8_pt = copy.deepcopy(mtq.INT8_DEFAULT_CFG)  # per-channel weights; inputs per token, dynamic (no SmoothQuant)
    for entry in int8_pt["quant_cfg"]:
        if entry.get("quantizer_name") == "*input_quantizer":
            entry["cfg"] = {"num_bits": 8, "axis": None, **PER_TOKEN}
    return {
        "kv_fp8": kv_only({"num_bits": (4, 3), "axis": None}),
        "kv_fp8_affine": kv_only({"num_bits": (4, 3), "axis": None, **AFFINE}),
        "kv_int8": kv_only({"num_bits": 8, "axis": None}),
        "kv_int8_affine": kv_only({"num_bits": 8, "axis": None, **AFFINE}),
        "fp8": copy.deepcopy(mtq.FP8_DEFAULT_CFG),
        "fp8_pc_pt": copy.deepcopy(mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG),
        "fp8_weights_only": only(mtq.FP8_DEFAULT_CFG, "*input_quantizer"),  # where fp8's loss comes from
        "fp8_inputs_only": only(mtq.FP8_DEFAULT_CFG, "*weight_quantizer"),
        "fp8_pc_static": per_channel_weights(mtq.FP8_DEFAULT_CFG),  # static per-tensor inputs (Q/DQ-expressible)
        "fp8_pc_weights_only": only(per_channel_weights(mtq.FP8_DEFAULT_CFG), "*input_quantizer"),
        "fp8_mse": {**copy.deepcopy(mtq.FP8_DEFAULT_CFG), "algorithm": {"method": "mse"}},  # scales by MSE search
        "fp8_pc_pt_mse": {**copy.deepcopy(mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG), "algorithm": {"method": "mse"}},
        "int8_pt": int8_pt,
        "int8_sq": smoothquant(),
    }


def smoothquant() -> dict:
    """camshaft's int8_sq: SmoothQuant at camshaft's alpha (layers sharing an input resmoothed after calibration)."""
    import modelopt.torch.quantization as mtq

    from camshaft.quantize.spec import SMOOTHQUANT_ALPHA

    cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
    cfg["algorithm"] = {"method": "smoothquant", "alpha": SMOOTHQUANT_ALPHA}
    return cfg


def resmooth(model) -> None:
    """As `camshaft quantize` does before the export: layers sharing an input get one pre_quant_scale."""
    import torch
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="+")
    p.add_argument("--text", type=Path, default=Path("out/q/heldout.txt"))
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--each-layer", action="store_true", help="also each layer / projection left float in turn")
    args = p.parse_args()
    import modelopt.torch.quantization as mtq

    texts = {"held-out": args.text.read_text()} | ({"validation": validation_text()} if args.each_layer else {})
    bench = FakeQuantBench(args.calib_size, args.calib_seq_len, texts)
    load, calibrate = bench.load, bench.calibrate

    def perplexity(model) -> float:
        return bench.perplexities(model)["held-out"]

    fp32 = bench.perplexities(load())
    base = fp32["held-out"]
    print(f"| config | perplexity | vs fp32 |\n|---|---|---|\n| fp32 | {base:.4f} | — |")
    available = configs()
    for name in args.configs:
        model = load()
        mtq.quantize(model, available[name], forward_loop=calibrate)
        if name == "int8_sq":
            resmooth(model)
        ppl = perplexity(model)
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % |", flush=True)
        if args.each_layer:
            each_part_float(model, name, lambda m: tuple(bench.perplexities(m).values()), tuple(fp32.values()))


def each_part_float(model, config: str, measure, base: tuple[float, float]) -> None:
    """Perplexity (held-out, validation) vs fp32 with one part of the model's linear layers left unquantized."""
    linears = [(n, m) for n, m in model.named_modules()
               if getattr(m, "weight_quantizer", None) is not None and m.weight_quantizer.is_enabled]

    def row(label: str, chosen: list) -> str:
        for _, m in chosen:
            for q in (m.weight_quantizer, m.input_quantizer):
                q.disable()
        ppls = measure(model)
        for _, m in chosen:
            for q in (m.weight_quantizer, m.input_quantizer):
                q.enable()
        cells = [f"{100 * (p / b - 1):+.2f} %" for p, b in zip(ppls, base, strict=True)]
        return f"| {config} | {label} | " + " | ".join(cells) + " |"

    print(f"\n| config | left float | held-out vs fp32 | validation vs fp32 |\n|---|---|---|---|\n"
          f"{row('nothing', [])}", flush=True)
    for i in range(model.config.num_hidden_layers):
        print(row(f"layer {i}", [(n, m) for n, m in linears if f".layers.{i}." in n]), flush=True)
    for proj in PROJECTIONS:
        print(row(f"every {proj}", [(n, m) for n, m in linears if n.endswith(proj)]), flush=True)
    last = f".layers.{model.config.num_hidden_layers - 1}.mlp."
    print(row("the last layer's MLP", [(n, m) for n, m in linears if last in n]), flush=True)
    print(row("the last layer's down_proj", [(n, m) for n, m in linears if n.endswith(last + "down_proj")]), flush=True)


if __name__ == "__main__":
    main()
