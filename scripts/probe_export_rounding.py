"""How many weights ModelOpt's export stores on another code than its fake quantizer computes.

The fake quantizer rounds w x (bound / amax); the export rounds w / (amax / bound). At a rounding tie the two can
land on neighbouring codes. For each format: quantize the checkpoint (camshaft's quantize_checkpoint, a few
calibration samples), capture the fake-quantized weights just before export, read the checkpoint back the way the
builder does, and count the weights that differ by more than float noise.

Usage: python scripts/probe_export_rounding.py MODEL_DIR FORMAT [FORMAT ...] [--calib-size N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from camshaft.builder.checkpoint import Checkpoint
from camshaft.quantize.modelopt_adapter import quantize_checkpoint
from camshaft.quantize.spec import QuantSpec


def probe(model_dir: Path, fmt: str, calib_size: int) -> tuple[int, int, list[str]]:
    captured: dict[str, np.ndarray] = {}

    def capture(model) -> None:
        import torch

        with torch.no_grad():
            for name, module in model.named_modules():
                quantizer = getattr(module, "weight_quantizer", None)
                if quantizer is not None and quantizer.is_enabled:
                    captured[name] = quantizer(module.weight).numpy().copy()

    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "ckpt"
        quantize_checkpoint(model_dir, output, QuantSpec(fmt), calib_size=calib_size, calib_seq_len=128,
                            on_quantized=capture)
        differing, total, where = 0, 0, []
        with Checkpoint(output) as checkpoint:
            for name, expected in captured.items():
                stored = checkpoint.quantized_linear(name, *expected.shape).weight()
                off = np.abs(stored - expected) > 1e-5 * np.abs(expected).max()
                total += expected.size
                if off.any():
                    differing += int(off.sum())
                    where.append(f"{name} ({int(off.sum())})")
    return differing, total, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("formats", nargs="+")
    parser.add_argument("--calib-size", type=int, default=8)
    args = parser.parse_args()
    print("| format | weights on another code | of | layers |")
    print("|---|---|---|---|")
    for fmt in args.formats:
        differing, total, where = probe(args.model_dir, fmt, args.calib_size)
        print(f"| {fmt} | {differing} | {total} | {', '.join(where[:4]) + (' ...' if len(where) > 4 else '')} |")


if __name__ == "__main__":
    main()
