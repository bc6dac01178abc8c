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
import math
import sysconfig
from pathlib import Path

import torch
import transformers

from camshaft.models import default_model_dir
from camshaft.quantize.calibration import load_texts, tokenize
from camshaft.quantize.modelopt_adapter import quantize_inputs_per_token

VALIDATION = Path(sysconfig.get_paths()["stdlib"], "idlelib", "HISTORY.txt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("alphas", nargs="+", type=float)
    p.add_argument("--heldout", type=Path, default=Path("out/q/heldout.txt"))
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=256)
    args = p.parse_args()
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    torch.set_num_threads(2)
    model_dir = default_model_dir("smollm2-135m-instruct")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = {"validation": VALIDATION.read_bytes()[:6000].decode(), "held-out": args.heldout.read_text()}
    ids = {name: torch.tensor([tokenizer(text)["input_ids"]]) for name, text in texts.items()}
    calib = tokenize(*load_texts(None), tokenizer, args.calib_size, args.calib_seq_len)

    def perplexities(model) -> dict[str, float]:
        out = {}
        with torch.no_grad():
            for name, row in ids.items():
                logits = model(row).logits[0, :-1].float()
                out[name] = math.exp(torch.nn.functional.cross_entropy(logits, row[0, 1:]).item())
        return out

    def calibrate(model) -> None:
        with torch.no_grad():
            for row in calib.input_ids:
                model(torch.from_numpy(row)[None])

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

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
        mtq.quantize(model, cfg, forward_loop=calibrate)
        with torch.no_grad():  # as quantize_checkpoint does: fused layers share one pre_quant_scale
            requantize_resmooth_fused_llm_layers(model)
        static = perplexities(model)
        quantize_inputs_per_token(model)
        per_token = perplexities(model)
        cells = [cell(r[name], name) for r in (static, per_token) for name in ("validation", "held-out")]
        print(f"| {alpha} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
