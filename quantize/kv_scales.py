"""KV cache tensors the unified HF export does not write: INT8 scales and the affine KV biases.

ModelOpt 0.47's unified HF export writes FP8 KV caches only (`self_attn.k_proj.k_scale` = amax / 448) and asserts on
INT8. camshaft calibrates INT8 KV quantizers with ModelOpt like any other, takes them out of the model before the
export, and adds the same tensors (amax / 127, the INT8 max bound) in a side file with kv_cache_quant_algo "INT8".
The affine KV quantizers' static biases (per KV head and channel, subtracted before quantizing) go to the same side
file under the names ModelOpt's export gives them (`self_attn.k_proj.k_bias` / `self_attn.v_proj.v_bias`), flattened
to [kv_heads * head_dim] float32 in the cache's channel order; they are taken out of the quantizers first, so the
export writes plain per-tensor KV scales and no second copy (its INT8 path would assert).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from camshaft.model_config import HF_QUANT_CONFIG

INT8_MAX_BOUND = 127.0
KV_SCALES_FILE = "kv_cache_scales.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def take_kv_biases(model: Any) -> dict[str, Any]:
    """The affine K/V biases of every attention module (by checkpoint tensor name), removed from the quantizers so the
    export sees plain per-tensor KV quantizers (their amax already describes the values after the bias)."""
    biases = {}
    for name, module in model.named_modules():
        for kind in ("k", "v"):
            quantizer = getattr(module, f"{kind}_bmm_quantizer", None)
            bias = getattr(quantizer, "_bias_value", None) if quantizer is not None and quantizer.is_enabled else None
            if bias is None:
                continue
            biases[f"{name}.{kind}_proj.{kind}_bias"] = bias.detach().float().reshape(-1).clone()  # [H, D]
            del quantizer._bias_value
    return biases


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


def write_kv_tensors(checkpoint_dir: Path, tensors: dict[str, Any]) -> None:
    """INT8 scales and/or affine biases into the side file (joining a sharded checkpoint's index)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(checkpoint_dir / KV_SCALES_FILE))
    index = checkpoint_dir / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, KV_SCALES_FILE))
        index.write_text(json.dumps(data, indent=2))


def mark_int8_kv_cache(checkpoint_dir: Path) -> None:
    path = checkpoint_dir / HF_QUANT_CONFIG
    config = json.loads(path.read_text())
    config["quantization"]["kv_cache_quant_algo"] = "INT8"
    path.write_text(json.dumps(config, indent=4))
    hf_config = checkpoint_dir / "config.json"
    data = json.loads(hf_config.read_text())
    if isinstance(data.get("quantization_config"), dict):
        data["quantization_config"]["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "int"}
        hf_config.write_text(json.dumps(data, indent=2))
