"""INT8 KV cache scales in the unified HF checkpoint.

ModelOpt 0.47's unified HF export writes FP8 KV caches only (`self_attn.k_proj.k_scale` = amax / 448) and asserts on
INT8. camshaft calibrates INT8 KV quantizers with ModelOpt like any other, takes them out of the model before the
export, and adds the same tensors (amax / 127, the INT8 max bound) in a side file with kv_cache_quant_algo "INT8".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from camshaft.model_config import HF_QUANT_CONFIG

INT8_MAX_BOUND = 127.0
KV_SCALES_FILE = "kv_cache_scales.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def take_int8_kv_scales(model: Any) -> dict[str, Any]:
    """The INT8 K/V scales of every attention module (by checkpoint tensor name); their quantizers are disabled so
    that ModelOpt's export accepts the model."""
    scales = {}
    for name, module in model.named_modules():
        for kind in ("k", "v"):
            quantizer = getattr(module, f"{kind}_bmm_quantizer", None)
            if quantizer is None or not quantizer.is_enabled:
                continue
            scales[f"{name}.{kind}_proj.{kind}_scale"] = (quantizer.amax.detach().float() / INT8_MAX_BOUND).reshape(())
            quantizer.reset_amax()  # the export writes any _amax it finds as an FP8 scale
            quantizer.disable()
    return scales


def write_int8_kv_scales(checkpoint_dir: Path, scales: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in scales.items()}, str(checkpoint_dir / KV_SCALES_FILE))
    index = checkpoint_dir / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(scales, KV_SCALES_FILE))
        index.write_text(json.dumps(data, indent=2))
    path = checkpoint_dir / HF_QUANT_CONFIG
    config = json.loads(path.read_text())
    config["quantization"]["kv_cache_quant_algo"] = "INT8"
    path.write_text(json.dumps(config, indent=4))
    hf_config = checkpoint_dir / "config.json"
    data = json.loads(hf_config.read_text())
    if isinstance(data.get("quantization_config"), dict):
        data["quantization_config"]["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "int"}
        hf_config.write_text(json.dumps(data, indent=2))
