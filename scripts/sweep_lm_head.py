#!/usr/bin/env python
"""An int4 lm_head's block size and float channels against perplexity and engine size, on real engine builds.

Takes a checkpoint quantized with `--lm-head int4` and the float checkpoint it came from. The head's input channels
are ranked as `camshaft quantize` ranks them (mean |input| of the output projection over the default calibration
tokens, float model); for each block size and channel count the checkpoint's record gets the top channels, camshaft's
head constants are set in this process only, and the engine is built and scored on the held-out and validation
texts. Engines stay under --work-dir for `scripts/bench_quant_decode.py`.

    .venv/bin/python scripts/sweep_lm_head.py out/q/int4_wo-h64f --model SMOLLM2 --blocks 32 64 --channels 0 4 8 16
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_quant import validation_text  # noqa: E402

from camshaft.builder import quantized  # noqa: E402
from camshaft.builder.build import build_engine  # noqa: E402
from camshaft.builder.config import BuildConfig  # noqa: E402
from camshaft.model_config import CAMSHAFT_QUANT_RECORD  # noqa: E402
from camshaft.quantize import spec  # noqa: E402
from camshaft.runtime.perplexity import engine_perplexity  # noqa: E402


def ranked_channels(model_dir: Path, calib_size: int, calib_seq_len: int) -> tuple[list[int], list[float], float]:
    """Channels by mean |input| of the output projection, largest first; the 8 largest means and the median."""
    import torch
    import transformers

    from camshaft.quantize.calibration import load_texts, tokenize
    from camshaft.quantize.model_edits import HeadInputs
    from camshaft.quantize.modelopt_adapter import calibration_loop

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    calib = tokenize(*load_texts(None), tokenizer, calib_size, calib_seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    inputs = HeadInputs(model)
    with torch.no_grad():
        calibration_loop(calib, "ranking the head's inputs", None)(model)
    inputs.remove()
    mean = inputs.total / (calib.num_samples * calib.seq_len)  # the head sees every calibration position
    largest = mean.sort(descending=True).values[:8].tolist()
    return inputs.largest(model.config.hidden_size), largest, float(mean.median())


def variant(checkpoint: Path, out: Path, channels: list[int]) -> Path:
    """A copy of the checkpoint (weights linked) whose record keeps `channels` float."""
    out.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        target = out / item.name
        if item.name == CAMSHAFT_QUANT_RECORD:
            record = json.loads(item.read_text())
            target.write_text(json.dumps({**record, "lm_head_float_channels": channels}))
        elif not target.exists():
            target.symlink_to(item.resolve())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", type=Path, help="quantized with --lm-head int4")
    p.add_argument("--model", type=Path, required=True, help="the float checkpoint it was quantized from")
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 64])
    p.add_argument("--channels", type=int, nargs="+", default=[0, 4, 8, 16])
    p.add_argument("--text", type=Path, default=Path("out/q/heldout.txt"))
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--work-dir", type=Path, default=Path("out/q/head-sweep"))
    args = p.parse_args()
    record = json.loads((args.checkpoint / CAMSHAFT_QUANT_RECORD).read_text())
    if record.get("lm_head") != "int4":
        sys.exit(f"{args.checkpoint} was not quantized with --lm-head int4")
    ranking, largest, median = ranked_channels(args.model, args.calib_size, args.calib_seq_len)
    texts = {"held-out": args.text.read_text(), "validation": validation_text()}
    print(f"head input channels by mean |input|, largest first: {ranking[:16]}; the largest means "
          f"{', '.join(f'{v:.2f}' for v in largest)}, the median {median:.2f}")
    print("\n| int4 head | float channels | held-out perplexity | validation perplexity | engine size |")
    print("|---|---|---|---|---|")
    for block in args.blocks:
        for count in args.channels:
            spec.LM_HEAD_BLOCKS["int4"] = block  # these dicts are shared with the builder: set for this process
            spec.LM_HEAD_FLOAT_CHANNELS["int4"] = count
            quantized.LM_HEAD_FORMATS["int4"] = quantized.HeadFormat(4, block, None)
            name = f"b{block}-k{count}"
            source = variant(args.checkpoint, args.work_dir / f"{name}-ckpt", ranking[:count])
            engine = args.work_dir / f"{name}-engine"
            if engine.exists():
                shutil.rmtree(engine)
            build_engine(BuildConfig(source, engine, max_seq_len=2048))
            ppl = {k: engine_perplexity(engine, t).perplexity for k, t in texts.items()}
            size = sum(f.stat().st_size for f in engine.rglob("*") if f.is_file()) / 2**20  # MiB, as du -sh
            print(f"| blocks of {block} | {count} | {ppl['held-out']:.3f} | {ppl['validation']:.3f} | "
                  f"{size:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
