"""What the fake-quant probes share (scripts/probe_modelopt_configs.py, scripts/sweep_smoothquant.py): SmolLM2 in
transformers on the CPU, the calibration rows `camshaft quantize` takes from the default corpus, and perplexity.

Texts: the held-out text of the accuracy table (the first 6000 bytes of the Python LICENSE, out/q/heldout.txt from
scripts/bench_quant_accuracy.sh) and a validation text for choosing settings (the first 6000 bytes of IDLE's
HISTORY.txt from the standard library), neither in the calibration corpus (stdlib docstrings).
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import transformers

from camshaft.models import default_model_dir
from camshaft.quantize.calibration import load_texts, tokenize

VALIDATION = Path(sysconfig.get_paths()["stdlib"], "idlelib", "HISTORY.txt")


class FakeQuantBench:
    def __init__(self, calib_size: int, calib_seq_len: int, texts: dict[str, str]) -> None:
        torch.set_num_threads(2)
        self.model_dir = default_model_dir("smollm2-135m-instruct")
        tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir)
        self.ids = {name: torch.tensor([tokenizer(text)["input_ids"]]) for name, text in texts.items()}
        self.calib = tokenize(*load_texts(None), tokenizer, calib_size, calib_seq_len)

    def load(self):
        return transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()

    def calibrate(self, model) -> None:
        """ModelOpt's forward_loop."""
        with torch.no_grad():
            for row in self.calib.input_ids:
                model(torch.from_numpy(row)[None])

    def perplexities(self, model) -> dict[str, float]:
        out = {}
        with torch.no_grad():
            for name, row in self.ids.items():
                logits = model(row).logits[0, :-1].float()
                out[name] = math.exp(torch.nn.functional.cross_entropy(logits, row[0, 1:]).item())
        return out


def validation_text() -> str:
    return VALIDATION.read_bytes()[:6000].decode()
