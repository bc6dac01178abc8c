"""A quantized checkpoint's quantization, read from hf_quant_config.json (or config.json's quantization_config) and
checked to be buildable and to agree with the checkpoint's other records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from camshaft.builder.quantized import KV_CACHE_ALGOS, MIXED, READABLE_QUANT_ALGOS
from camshaft.errors import CheckpointError
from camshaft.model_config import CAMSHAFT_QUANT_RECORD, HF_QUANT_CONFIG, unreadable_quantization
from camshaft.quantize.spec import FORMATS


def read_quant_config(model_dir: Path) -> dict[str, Any] | None:
    """hf_quant_config.json's "quantization" section (None for a float checkpoint), checked to be buildable."""
    path = model_dir / HF_QUANT_CONFIG
    method = unreadable_quantization(model_dir)
    if method == "modelopt":
        return _checked(model_dir, model_dir / "config.json", _from_config_json(model_dir))
    if method is not None:
        raise CheckpointError(
            f"{model_dir}/config.json says the weights are quantized (quant_method {method}), but there is no "
            f"{HF_QUANT_CONFIG}: camshaft reads quantized checkpoints in ModelOpt's unified format only. Build from "
            "the float checkpoint (quantize it with `camshaft quantize` or `camshaft build --quant`)"
        )
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        quant = {**raw["quantization"], "producer": raw.get("producer")}
    except (ValueError, RecursionError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is malformed: {str(exc)[:200]}") from exc
    quant = _checked(model_dir, path, quant)
    _check_config_json_agrees(model_dir, quant)
    return quant


def _check_config_json_agrees(model_dir: Path, quant: dict[str, Any]) -> None:
    """ModelOpt writes the quantization twice (hf_quant_config.json, and config.json's quantization_config, which
    vLLM reads): files that disagree were edited or mixed from two exports, and no reading of them is right."""
    try:
        config = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, RecursionError, AttributeError):
        return  # the checkpoint's own reader says what is wrong with config.json
    if not isinstance(config, dict) or config.get("quant_method") != "modelopt":
        return
    other = _from_config_json(model_dir)
    if other["kv_cache_quant_algo"] is None:  # older ModelOpt exports wrote hf_quant_config.json's section as is
        other["kv_cache_quant_algo"] = config.get("kv_cache_quant_algo")
    for key, what in (("quant_algo", "the layers"), ("kv_cache_quant_algo", "the KV cache")):
        theirs, ours = other.get(key), quant.get(key)
        if theirs is not None and theirs != ours:
            raise CheckpointError(
                f"{model_dir}: {HF_QUANT_CONFIG} quantizes {what} as {ours}, config.json's quantization_config as "
                f"{theirs}; the files were edited or come from two exports: copy both from where the checkpoint "
                "came from, or quantize again")


def _from_config_json(model_dir: Path) -> dict[str, Any]:
    """hf_quant_config.json's section from config.json's quantization_config, which ModelOpt writes from it
    (`convert_hf_quant_config_format`, as vLLM reads it): the same quant_algo, quantized_layers and producer,
    exclude_modules as "ignore", the KV cache's algorithm as a scheme, group sizes only in config_groups (none for
    int4 AWQ: refused below)."""
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    scheme = config.get("kv_cache_scheme")
    kv = {("float", 8): "FP8", ("int", 8): "INT8"}.get((scheme.get("type"), scheme.get("num_bits")), str(scheme)) \
        if isinstance(scheme, dict) else scheme
    groups = config.get("config_groups") if isinstance(config.get("config_groups"), dict) else {}
    sizes = {size for g in groups.values() if isinstance(g, dict) and isinstance(g.get("weights"), dict)
             for size in [g["weights"].get("group_size")] if isinstance(size, int) and not isinstance(size, bool)}
    quant = {"quant_algo": config.get("quant_algo"), "kv_cache_quant_algo": kv, "producer": config.get("producer"),
             "exclude_modules": config.get("ignore") or [], "source": "config.json"}
    if "quantized_layers" in config:
        quant["quantized_layers"] = config["quantized_layers"]
    if len(sizes) == 1:
        quant["group_size"] = sizes.pop()
    return quant


def _copy_back(quant: dict[str, Any], written: str) -> str:
    """For what config.json's quantization_config lacks: where it is, and what to do."""
    if quant.get("source") != "config.json":
        return ""
    return f" ({written} to {HF_QUANT_CONFIG} only): copy that file from where the checkpoint came from"


def _checked(model_dir: Path, path: Path, quant: dict[str, Any]) -> dict[str, Any]:
    algo = quant.get("quant_algo")
    layers = quant.get("quantized_layers")
    if algo == MIXED and not (isinstance(layers, dict) and layers
                              and all(isinstance(v, dict) for v in layers.values())):
        raise CheckpointError(f"{path} is {MIXED} but has no quantized_layers {{layer: {{quant_algo: ...}}}}"
                              + _copy_back(quant, "older ModelOpt versions write them"))
    if algo is None and quant.get("kv_cache_quant_algo") is None:
        raise CheckpointError(f"{path} quantizes nothing (quant_algo and kv_cache_quant_algo are null); remove it to "
                              "build the float checkpoint")
    # quant_algo null: ModelOpt's export of a checkpoint with float layers and a quantized KV cache
    for name, layer_algo in ([(n, v.get("quant_algo")) for n, v in layers.items()] if algo == MIXED
                             else [(None, algo)] if algo is not None else []):
        if not isinstance(layer_algo, str) or layer_algo not in READABLE_QUANT_ALGOS:
            where = f"{model_dir} quantizes {name} as" if name else f"{model_dir} is quantized as"
            raise CheckpointError(
                f"{where} {layer_algo}; camshaft builds {', '.join(READABLE_QUANT_ALGOS)} (and {MIXED} "
                f"checkpoints of those) (`camshaft quantize --quant {'|'.join(FORMATS)}`)"
            )
        if (layers[name] if name else quant).get("has_zero_point", quant.get("has_zero_point")):
            raise CheckpointError(f"{path} stores {name or layer_algo} with zero points (has_zero_point true: "
                                  "asymmetric int4); camshaft builds symmetric ones, as ModelOpt exports them")
        group = (layers[name] if name else quant).get("group_size", quant.get("group_size"))
        if READABLE_QUANT_ALGOS[layer_algo].blockwise and not isinstance(group, int):
            raise CheckpointError(f"{path} has no integer group_size for {name or layer_algo}"
                                  + _copy_back(quant, "ModelOpt writes it"))
    kv_algo = quant.get("kv_cache_quant_algo")
    if kv_algo is not None and (not isinstance(kv_algo, str) or kv_algo not in KV_CACHE_ALGOS):
        raise CheckpointError(
            f"{model_dir} quantizes the KV cache as {kv_algo}; camshaft builds {' or '.join(KV_CACHE_ALGOS)} KV "
            "caches"
        )
    record = model_dir / CAMSHAFT_QUANT_RECORD
    if record.is_file():
        try:
            recorded = json.loads(record.read_text())
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{record} is malformed: {str(exc)[:200]}") from exc
        if not isinstance(recorded, dict):
            raise CheckpointError(f"{record} is malformed: an object of camshaft quantize's settings, not "
                                  f"{type(recorded).__name__}; quantize the checkpoint again")
        _check_record_agrees(model_dir, path, quant, recorded)
        quant = {**quant, "camshaft": recorded}
    return quant


def _check_record_agrees(model_dir: Path, path: Path, quant: dict[str, Any], recorded: dict[str, Any]) -> None:
    """camshaft quantize's record names the KV cache it calibrated and the files it wrote: a checkpoint that says
    otherwise was edited, or lost a file (a KV cache's biases, without which its scales clip)."""
    kv = {"FP8": "fp8", "INT8": "int8"}.get(quant.get("kv_cache_quant_algo"))
    if "kv_cache_dtype" in recorded and recorded["kv_cache_dtype"] != kv:
        raise CheckpointError(
            f"{model_dir}: {CAMSHAFT_QUANT_RECORD} says the KV cache was calibrated as {recorded['kv_cache_dtype']}, "
            f"{path.name} quantizes it as {quant.get('kv_cache_quant_algo')}; one was edited: copy them back from "
            "where the checkpoint came from, or quantize again")
    files = recorded.get("files")
    missing = [name for name in files if isinstance(name, str) and name.endswith(".safetensors")
               and not (model_dir / name).is_file()] if isinstance(files, list) else []
    if missing:
        raise CheckpointError(
            f"{model_dir} lacks {', '.join(missing)}, which camshaft quantize wrote ({CAMSHAFT_QUANT_RECORD} lists "
            "it): copy it back from where the checkpoint came from, or quantize again")
