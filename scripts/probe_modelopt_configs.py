#!/usr/bin/env python
"""Perplexity of ModelOpt quantization configs on SmolLM2, as fake-quant models in transformers (no engine build).

A quick way to see what a config would cost before wiring it into camshaft: the KV cache quantizers per-tensor vs
affine (the bias camshaft adopted), FP8 per-channel/per-token, INT8 with per-token dynamic activations. Same held-out
text and calibration corpus as scripts/bench_quant_accuracy.sh (run that first for out/q/heldout.txt).

    .venv/bin/python scripts/probe_modelopt_configs.py kv_fp8 kv_fp8_affine kv_int8 kv_int8_affine fp8_pc_pt int8_pt
"""

from __future__ import annotations

import argparse
import copy
import math
from pathlib import Path

import torch
import transformers

from camshaft.models import default_model_dir
from camshaft.quantize.calibration import load_texts, tokenize

KV = "*[kv]_bmm_quantizer"
AFFINE = {"bias": {-2: None, -4: None, "type": "static"}}
PER_TOKEN = {"type": "dynamic", "block_sizes": {-1: None}}


def configs() -> dict[str, dict]:
    import modelopt.torch.quantization as mtq

    def kv_only(cfg: dict) -> dict:
        return {"quant_cfg": [{"quantizer_name": "*", "enable": False}, {"quantizer_name": KV, "cfg": cfg}],
                "algorithm": "max"}

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
        "int8_pt": int8_pt,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="+")
    p.add_argument("--text", type=Path, default=Path("out/q/heldout.txt"))
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=256)
    args = p.parse_args()
    import modelopt.torch.quantization as mtq

    torch.set_num_threads(2)
    model_dir = default_model_dir("smollm2-135m-instruct")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tokenizer(args.text.read_text())["input_ids"]])
    calib = tokenize(*load_texts(None), tokenizer, args.calib_size, args.calib_seq_len)

    def perplexity(model) -> float:
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())

    def calibrate(model) -> None:
        with torch.no_grad():
            for row in calib.input_ids:
                model(torch.from_numpy(row)[None])

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    base = perplexity(load())
    print(f"| config | perplexity | vs fp32 |\n|---|---|---|\n| fp32 | {base:.4f} | — |")
    available = configs()
    for name in args.configs:
        model = load()
        mtq.quantize(model, available[name], forward_loop=calibrate)
        ppl = perplexity(model)
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % |", flush=True)


if __name__ == "__main__":
    main()
