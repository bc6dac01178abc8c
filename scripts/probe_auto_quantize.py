#!/usr/bin/env python
"""ModelOpt's AutoQuantize (TensorRT-LLM's `--auto_quantize_bits`) on SmolLM2: per-layer sensitivity by gradients,
then the layers it keeps float to meet an effective-bits budget; perplexity of each budget's fake-quant model.

Would it find the few layers plain fp8 loses most in? (`--exclude` of the last MLP does: docs/quantize.md.)

    .venv/bin/python scripts/probe_auto_quantize.py 9.75 9.9 10.2 [--format FP8_DEFAULT_CFG]

Budgets are in ModelOpt's effective bits, where a float layer counts 16 and the embedding and head (kept float) count
too: all of SmolLM2's layers in fp8 is 9.68. Needs scripts/bench_quant_accuracy.sh's out/q/heldout.txt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_quant import FakeQuantBench, validation_text  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bits", nargs="+", type=float)
    p.add_argument("--format", default="FP8_DEFAULT_CFG")
    p.add_argument("--text", type=Path, default=Path("out/q/heldout.txt"))
    args = p.parse_args()
    import modelopt.torch.quantization as mtq
    import torch

    bench = FakeQuantBench(32, 256, {"held-out": args.text.read_text(), "validation": validation_text()})
    base = bench.perplexities(bench.load())
    batches = [torch.from_numpy(row)[None] for row in bench.calib.input_ids]
    print("| effective bits | layers kept float | held-out vs fp32 | validation vs fp32 | search s |")
    print("|---|---|---|---|---|")
    for bits in args.bits:
        model, start = bench.load(), time.perf_counter()
        model, state = mtq.auto_quantize(
            model, constraints={"effective_bits": bits}, quantization_formats=[args.format], data_loader=batches,
            forward_step=lambda m, batch: m(batch, labels=batch), loss_func=lambda out, batch: out.loss,
            disabled_layers=["*lm_head*"], num_calib_steps=len(batches), num_score_steps=len(batches))
        recipe = (state.get("best") or {}).get("recipe") or {}
        kept = sorted(name.removesuffix(".quant_recipe") for name, choice in recipe.items()
                      if "lm_head" not in name and ("None" in str(choice) or "NONE" in str(choice)))
        ppl = bench.perplexities(model)
        print(f"| {bits} | {len(kept)}: {', '.join(kept)} | {100 * (ppl['held-out'] / base['held-out'] - 1):+.2f} % | "
              f"{100 * (ppl['validation'] / base['validation'] - 1):+.2f} % | {time.perf_counter() - start:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
