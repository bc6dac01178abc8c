"""What camshaft does to ModelOpt's calibrated model and its export beyond ModelOpt: inputs quantized per token at
run time, the quant_algo the export has no name for, and the lm_head's input statistics (its float channels)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from camshaft.model_config import HF_QUANT_CONFIG
from camshaft.quantize.spec import QuantizeError


def quantize_inputs_per_token(model: Any) -> None:
    """Every enabled linear-layer input quantizer becomes dynamic per token (ModelOpt's form: block_sizes {-1: None},
    the row's own amax at run time); its calibrated amax goes, the SmoothQuant pre_quant_scale stays."""
    for module in model.modules():
        quantizer = getattr(module, "input_quantizer", None)
        if quantizer is None or not quantizer.is_enabled or getattr(module, "weight_quantizer", None) is None:
            continue
        quantizer.set_from_attribute_config({"num_bits": quantizer.num_bits, "axis": None, "type": "dynamic",
                                             "block_sizes": {-1: None}})
        if hasattr(quantizer, "_amax"):
            delattr(quantizer, "_amax")


def mark_quant_algo(checkpoint_dir: Path, quant_algo: str) -> None:
    """Name the checkpoint's format where ModelOpt's export has no name for it (it writes INT8 SmoothQuant with
    per-token inputs as the per-tensor W8A8_SQ_PER_CHANNEL)."""
    path = checkpoint_dir / HF_QUANT_CONFIG
    config = json.loads(path.read_text())
    config["quantization"]["quant_algo"] = quant_algo
    path.write_text(json.dumps(config, indent=4))
    hf_config = checkpoint_dir / "config.json"
    data = json.loads(hf_config.read_text())
    if isinstance(data.get("quantization_config"), dict) and "quant_algo" in data["quantization_config"]:
        data["quantization_config"]["quant_algo"] = quant_algo
        hf_config.write_text(json.dumps(data, indent=2))


class HeadInputs:
    """Mean |input| per channel of the model's output projection over the tokens it sees (the calibration passes):
    the builder keeps the largest few float in a quantized lm_head."""

    def __init__(self, model: Any) -> None:
        self.total: Any = None
        self.handle = model.get_output_embeddings().register_forward_hook(self._see)

    def _see(self, module: Any, inputs: tuple, output: Any) -> None:
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
        total = x.abs().sum(0)
        self.total = total if self.total is None else self.total + total

    def remove(self) -> None:
        self.handle.remove()

    def largest(self, count: int) -> list[int]:
        """The `count` channels with the largest mean |input| (the same order as the sums), largest first."""
        if self.total is None:
            raise QuantizeError("calibration never ran the output projection; cannot choose the lm_head's float "
                                "channels (use --lm-head float)")
        return [int(i) for i in self.total.argsort(descending=True)[:count]]
