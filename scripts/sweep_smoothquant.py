#!/usr/bin/env python
"""SmoothQuant's alpha on SmolLM2, as ModelOpt fake-quant models in transformers: perplexity with static per-tensor
int8 inputs (`int8_sq`) and with the same smoothed model's inputs quantized per token at run time (`int8_sq_pt`),
each as `camshaft quantize` leaves it before the export (layers sharing an input resmoothed to one pre_quant_scale).

Alpha is chosen on the validation text (the first 6000 bytes of IDLE's HISTORY.txt from the standard library), which
is neither the calibration corpus (stdlib docstrings) nor the held-out text of the accuracy table (the first 6000
bytes of the Python LICENSE, out/q/heldout.txt from scripts/bench_quant_accuracy.sh); both are reported.

    .venv/bin/python scripts/sweep_smoothquant.py 0.5 0.6 0.7 0.8 0.9 1.0
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_quant import FakeQuantBench, validation_text  # noqa: E402

from camshaft.quantize.model_edits import quantize_inputs_per_token  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("alphas", nargs="+", type=float)
    p.add_argument("--heldout", type=Path, default=Path("out/q/heldout.txt"))
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=256)
    args = p.parse_args()
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    bench = FakeQuantBench(args.calib_size, args.calib_seq_len,
                           {"validation": validation_text(), "held-out": args.heldout.read_text()})
    perplexities, load = bench.perplexities, bench.load
    base = perplexities(load())
    print("| alpha | int8_sq validation | int8_sq held-out | int8_sq_pt validation | int8_sq_pt held-out |")
    print("|---|---|---|---|---|")
    print(f"| fp32 | {base['validation']:.4f} | {base['held-out']:.4f} | — | — |")

    def cell(ppl: float, name: str) -> str:
        return f"{ppl:.4f} ({100 * (ppl / base[name] - 1):+.2f} %)"

    for alpha in args.alphas:
        model = load()
        cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
        cfg["algorithm"] = {"method": "smoothquant", "alpha": alpha}
        mtq.quantize(model, cfg, forward_loop=bench.calibrate)
        with torch.no_grad():  # as quantize_checkpoint does: fused layers share one pre_quant_scale
            requantize_resmooth_fused_llm_layers(model)
        static = perplexities(model)
        quantize_inputs_per_token(model)
        per_token = perplexities(model)
        cells = [cell(r[name], name) for r in (static, per_token) for name in ("validation", "held-out")]
        print(f"| {alpha} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
