#!/usr/bin/env python
"""Fake-quant perplexity of per-tensor fp8 with SmoothQuant-style smoothing first, on SmolLM2 (held-out and
validation texts, as scripts/probe_modelopt_configs.py --each-layer).

ModelOpt 0.47 smooths int8 only ("Only int8 smoothing is supported"); this probe lifts that one check in a copy of its
`smoothquant` calibration, nothing else, to see whether smoothing would bring plain fp8 within the +1 % target.
A probe, not a format: camshaft does not ship it (docs/quantize.md, "fp8 with smoothing").

    .venv/bin/python scripts/probe_fp8_smoothing.py plain 0.15 0.3 0.5 0.8
"""

from __future__ import annotations

import copy
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_quant import FakeQuantBench, validation_text  # noqa: E402
from probe_modelopt_configs import resmooth  # noqa: E402


def allow_fp8_smoothing() -> None:
    import modelopt.torch.quantization.mode as mode
    import modelopt.torch.quantization.model_calib as calib

    source = inspect.getsource(calib.smoothquant).replace(
        "module.input_quantizer.num_bits != 8 or module.weight_quantizer.num_bits != 8", "False")
    namespace = dict(vars(calib))
    exec(source, namespace)  # noqa: S102 - ModelOpt's own function, one condition removed
    for cls in vars(mode).values():
        if inspect.isclass(cls) and getattr(getattr(cls, "_calib_func", None), "__name__", "") == "smoothquant":
            cls._calib_func = namespace["smoothquant"]


def main() -> None:
    import modelopt.torch.quantization as mtq

    allow_fp8_smoothing()
    heldout = Path("out/q/heldout.txt").read_text()
    bench = FakeQuantBench(32, 256, {"held-out": heldout, "validation": validation_text()})
    base = bench.perplexities(bench.load())
    print(f"fp32 {base}")
    for alpha in sys.argv[1:] or ["plain", "0.3"]:
        cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
        if alpha != "plain":
            cfg["algorithm"] = {"method": "smoothquant", "alpha": float(alpha)}
        model = bench.load()
        mtq.quantize(model, cfg, forward_loop=bench.calibrate)
        if alpha != "plain":
            resmooth(model)
        ppl = bench.perplexities(model)
        print(alpha, {k: f"{100 * (v / base[k] - 1):+.2f} %" for k, v in ppl.items()}, flush=True)


if __name__ == "__main__":
    main()
