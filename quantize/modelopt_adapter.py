"""Offline quantization with NVIDIA ModelOpt on the CPU: HF checkpoint → calibrated model → unified HF checkpoint.

Every input (format, group size against the model's dimensions, calibration data, output directory) is checked
before the model is loaded. The checkpoint is written to a sibling staging directory and moved into place at the
end, so an interrupted run never leaves a half-written checkpoint under the output name.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from camshaft.engine_files import NAMED_TEMPLATES
from camshaft.errors import DISK_FULL, CheckpointError, UnsupportedModelError, needs_extra
from camshaft.float_model import load_float_model, transformers_tokenizer
from camshaft.model_config import (
    CAMSHAFT_QUANT_RECORD,
    HF_QUANT_CONFIG,
    TOKENIZER_FILES,
    ModelConfig,
    check_tokenizer_vocab,
    missing_checkpoint,
    require_tokenizer,
    unreadable_quantization,
)
from camshaft.outdir import check_replaceable, replace_dir, staged
from camshaft.quantize.calibration import (
    DEFAULT_CALIB_SEQ_LEN,
    DEFAULT_CALIB_SIZE,
    MAX_CHARS_PER_TOKEN,
    CalibrationSet,
    check_sizes,
    load_texts,
    tokenize,
)
from camshaft.quantize.excludes import check_excludes_match, module_names
from camshaft.quantize.kv_scales import mark_int8_kv_cache, take_int8_kv_scales, take_kv_biases, write_kv_tensors
from camshaft.quantize.model_edits import HeadInputs, mark_quant_algo, quantize_inputs_per_token
from camshaft.quantize.spec import (
    LM_HEAD_FLOAT_CHANNELS,
    QuantizeError,
    QuantSpec,
    check_lm_head_fits,
    modelopt_config,
    resolve_group_size,
)
from camshaft.weight_files import refuse_stored_codes, stored_float_dtype

Progress = Callable[[str], None]


@dataclass(frozen=True)
class QuantizeResult:
    output: Path
    spec: QuantSpec
    group_size: int | None
    calib_samples: int
    calib_seq_len: int
    calib_source: str
    seconds: dict[str, float]


def import_modelopt():
    import warnings

    # ModelOpt 0.47 warns at import that this transformers is untested and to upgrade itself, which the <0.48 pin
    # forbids: camshaft's tests run this pair, so the warning would only mislead
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="transformers .* is not tested with current version of modelopt")
            import modelopt.torch.quantization as mtq
            import requests  # noqa: F401  (modelopt imports it without declaring it)
            from modelopt.torch.export import export_hf_checkpoint
    except ImportError as exc:
        raise QuantizeError(needs_extra(f"quantizing (NVIDIA ModelOpt is not available: {exc})", "quantize")) from exc
    return mtq, export_hf_checkpoint


def written_files(checkpoint: Path) -> set[str]:
    """What `camshaft quantize` wrote into `checkpoint`: none of another tool's checkpoint, all of one camshaft wrote
    before its record listed the files."""
    try:
        record = json.loads((checkpoint / CAMSHAFT_QUANT_RECORD).read_text())
    except (OSError, ValueError, RecursionError):
        return set()
    files = record.get("files") if isinstance(record, dict) else None
    if isinstance(files, list) and not all(isinstance(name, str) for name in files):
        return set()  # a damaged record: none of the files is known to be ours
    return {CAMSHAFT_QUANT_RECORD, *files} if isinstance(files, list) else set(os.listdir(checkpoint))


def quantize_checkpoint(model_dir: str | Path, output: str | Path, spec: QuantSpec | str, *,
                        calib_data: str | Path | None = None, calib_size: int = DEFAULT_CALIB_SIZE,
                        calib_seq_len: int = DEFAULT_CALIB_SEQ_LEN,
                        progress: Progress = lambda _: None, progress_bar: bool = False,
                        on_quantized: Callable[[Any], None] | None = None) -> QuantizeResult:
    """Calibrate and quantize a HF checkpoint with ModelOpt and write ModelOpt's unified HF checkpoint.

    `on_quantized(model)` sees the fake-quantized model before export (tests use it to record reference outputs);
    the export packs the model's weights in place, so the model cannot run after it.
    """
    model_dir, output = Path(model_dir), Path(output)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    # --- checks, all before any long work ---
    if isinstance(spec, str):  # the format, as the CLI's --quant takes it
        spec = QuantSpec(spec)
    if not isinstance(spec, QuantSpec):
        raise QuantizeError(f"spec is a QuantSpec (e.g. QuantSpec(\"int4_awq\")) or a format name, got {spec!r:.80}")
    if not model_dir.is_dir():
        raise CheckpointError(missing_checkpoint(model_dir))
    method = unreadable_quantization(model_dir)
    if (model_dir / HF_QUANT_CONFIG).is_file() or method is not None:
        where = HF_QUANT_CONFIG if method is None else f"config.json's quantization_config, quant_method {method}"
        raise QuantizeError(f"{model_dir} is already quantized ({where}); quantize the original checkpoint")
    refuse_stored_codes(model_dir, QuantizeError, "quantize the original float checkpoint")
    model_config = ModelConfig.from_hf_dir(model_dir)
    if model_config.moe_layers:
        raise UnsupportedModelError(f"{model_dir}: quantizing a mixture of experts is not supported yet; build the "
                                    "float checkpoint (camshaft build without --quant)")
    source_dtype = stored_float_dtype(model_dir)  # the export is float32: builds take the model's own type from this
    group_size = resolve_group_size(spec, model_config)
    check_lm_head_fits(spec, model_config)
    check_sizes(calib_size, calib_seq_len, model_config.max_position_embeddings)
    check_excludes_match(spec, module_names(model_dir))
    check_replaceable(output, HF_QUANT_CONFIG, "a quantized checkpoint", QuantizeError, owned=written_files)
    require_tokenizer(model_dir)
    texts, source = load_texts(calib_data, max_chars=calib_size * calib_seq_len * MAX_CHARS_PER_TOKEN)
    mtq, export_hf_checkpoint = import_modelopt()
    cfg = modelopt_config(spec, group_size)

    import torch

    tokenizer = transformers_tokenizer(model_dir, f"--model {model_dir}")
    if getattr(tokenizer, "is_fast", False):
        check_tokenizer_vocab(tokenizer, model_config.vocab_size)
    calib = tokenize(texts, source, tokenizer, calib_size, calib_seq_len, progress)
    if calib.input_ids.max() >= model_config.vocab_size:
        beyond = sorted(t for t, i in tokenizer.get_added_vocab().items() if i >= model_config.vocab_size)
        raise QuantizeError(f"the calibration text ({source}) holds tokens past the model's vocabulary "
                            f"({model_config.vocab_size}): {', '.join(beyond[:5]) or 'ids the model has not'}; take "
                            "them out of the text")
    timings["prepare"] = round(time.perf_counter() - start, 2)
    progress(f"loading {model_config.architecture} from {model_dir} (float32, CPU)")
    t = time.perf_counter()
    model = load_float_model(model_dir, f"--model {model_dir}", "quantize")
    if not getattr(model.config, "architectures", None):  # ModelOpt's HF export needs it
        model.config.architectures = [type(model).__name__]
    timings["load"] = round(time.perf_counter() - t, 2)

    t = time.perf_counter()
    desc = f"calibrating {spec.format}" + (f" (group {group_size})" if group_size else "")
    progress(f"{desc} on {calib.num_samples} x {calib.seq_len} tokens from {source}")
    float_channels = LM_HEAD_FLOAT_CHANNELS[spec.lm_head]
    head_inputs = HeadInputs(model) if float_channels else None
    try:
        with torch.inference_mode(False), torch.no_grad():
            mtq.quantize(model, cfg, forward_loop=calibration_loop(calib, desc, progress if progress_bar else None))
    finally:
        if head_inputs is not None:
            head_inputs.remove()
    timings["calibrate"] = round(time.perf_counter() - t, 2)
    # The export's first step, done here so `on_quantized` sees the model the checkpoint holds: layers sharing an
    # input get one pre_quant_scale (AWQ: folded into the norm before them) and input scale, and are requantized.
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)
    if spec.info.per_token_inputs:
        quantize_inputs_per_token(model)
    if on_quantized is not None:
        on_quantized(model)
    kv_tensors = take_kv_biases(model)  # the export then sees per-tensor KV quantizers only
    kv_tensors.update(take_int8_kv_scales(model) if spec.kv_cache_dtype == "int8" else {})

    t = time.perf_counter()
    progress(f"exporting unified HF checkpoint to {output}")
    with staged(output) as staging:
        with torch.no_grad(), _export_failures(output):
            export_hf_checkpoint(model, export_dir=str(staging))
        if not (staging / HF_QUANT_CONFIG).is_file():
            raise QuantizeError(f"ModelOpt's export wrote no {HF_QUANT_CONFIG}; nothing was quantized")
        for written in staging.iterdir():  # its safetensors come private (mkstemp): servers may run as other users
            if written.is_file():
                written.chmod(0o644)
        if spec.info.per_token_inputs:
            mark_quant_algo(staging, spec.info.checkpoint_algo)
        if kv_tensors:
            write_kv_tensors(staging, kv_tensors)
        if spec.kv_cache_dtype == "int8":
            mark_int8_kv_cache(staging)
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, staging / name)
        if (model_dir / NAMED_TEMPLATES).is_dir():  # transformers' named chat templates (tool_use, ...)
            shutil.copytree(model_dir / NAMED_TEMPLATES, staging / NAMED_TEMPLATES)
        timings["export"] = round(time.perf_counter() - t, 2)
        timings["total"] = round(time.perf_counter() - start, 2)
        record = {
            "format": spec.format, "kv_cache_dtype": spec.kv_cache_dtype, "group_size": group_size,
            "source_dtype": source_dtype,
            "exclude": list(spec.exclude), "modelopt_config": spec.info.modelopt_config,
            "algorithm": cfg.get("algorithm"), "lm_head": spec.lm_head,
            **({"lm_head_float_channels": head_inputs.largest(float_channels)} if head_inputs else {}),
            "calibration": {"source": source, "samples": calib.num_samples, "seq_len": calib.seq_len,
                            "tokens_sha256": samples_sha256(calib.input_ids)},
            "seconds": timings, "tools": _tool_versions(), "files": sorted(os.listdir(staging)),
        }
        (staging / CAMSHAFT_QUANT_RECORD).write_text(json.dumps(record, indent=2))
        replace_dir(staging, output)
    progress(f"quantized checkpoint written to {output} in {timings['total']} s")
    return QuantizeResult(output, spec, group_size, calib.num_samples, calib.seq_len, source, timings)


def calibration_loop(calib: CalibrationSet, description: str, progress: Progress | None) -> Callable[[Any], None]:
    """ModelOpt's forward loop over the samples (AWQ runs it more than once); `progress` sees each sample's step."""
    def forward_loop(model) -> None:
        import torch

        for i in range(calib.num_samples):
            model(torch.from_numpy(calib.input_ids[i: i + 1]))
            if progress is not None:
                progress(f"{description}: sample {i + 1}/{calib.num_samples}")

    return forward_loop


def samples_sha256(input_ids: Any) -> str:
    """The calibration samples' hash: their shape (4 x 8 tokens is not 2 x 16), then their token ids."""
    digest = hashlib.sha256(f"{input_ids.shape} {input_ids.dtype}:".encode())
    digest.update(input_ids.tobytes())
    return digest.hexdigest()


def _tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    tools = {"python": platform.python_version()}  # the built-in corpus is its standard library's docstrings
    for name in ("nvidia-modelopt", "torch", "transformers"):
        try:
            tools[name] = version(name)
        except PackageNotFoundError:
            pass
    return tools


@contextmanager
def _export_failures(output: Path) -> Iterator[None]:
    """A full disk while exporting, safetensors' own error or an OSError, as a QuantizeError saying where."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        full = exc.errno in DISK_FULL if isinstance(exc, OSError) else \
            any(said in str(exc) for said in ("No space left", "Disk quota", "File too large"))
        if not full:
            raise
        raise QuantizeError(f"writing the quantized checkpoint beside {output} failed ({exc}); free some space there "
                            "or choose another --output (calibration has to run again)") from exc
