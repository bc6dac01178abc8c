"""Commands that make things: models fetch, build (with --quant), quantize."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from camshaft.builder.config import MOST_SEQUENCES, MOST_STEP_TOKENS
from camshaft.cli import app, err, models_app, progress, require_stdout
from camshaft.errors import CamshaftError
from camshaft.quantize.calibration import DEFAULT_CALIB_SEQ_LEN, DEFAULT_CALIB_SIZE, LEAST_CALIB_SEQ_LEN
from camshaft.quantize.spec import FORMATS

if TYPE_CHECKING:
    from camshaft.builder.config import BuildConfig


@models_app.command("fetch")
def models_fetch(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Model name, e.g. smollm2-135m-instruct")],
    output: Annotated[Path | None, typer.Option(help="Checkpoint directory (default: the camshaft cache)")] = None,
    force: Annotated[bool, typer.Option("--force", help="Fetch again over a complete fetch (one damaged since)")]
    = False,
) -> None:
    """Fetch a known model and convert it to a Hugging Face checkpoint directory."""
    from camshaft.models import default_model_dir, fetch_model

    path = fetch_model(name, output or default_model_dir(name), progress=progress, force=force)
    typer.echo(str(path))


@models_app.command("list")
def models_list() -> None:
    """The models `models fetch` knows, where each comes from, and whether it is in the camshaft cache."""
    require_stdout()
    from camshaft.models import KNOWN_MODELS, default_model_dir, is_fetched

    for name, model in sorted(KNOWN_MODELS.items()):
        where = default_model_dir(name)
        size = sum(f.stat().st_size for f in where.iterdir() if f.is_file()) if is_fetched(name, where) else 0
        state = f"fetched: {where} ({size / 1e6:.0f} MB)" if size else "not fetched"
        typer.echo(f"{name}  {model.architecture}, from {model.package}=={model.version} "
                   f"({Path(model.gguf_member).name})  {state}")


QuantOption = Annotated[str, typer.Option(help=" | ".join(FORMATS))]
KVDtypeOption = Annotated[str | None, typer.Option(help="Also quantize the KV cache: fp8 | int8")]
GROUP_HELP = "INT4 layers' group size (weights sharing a scale): auto | 128 | 64 | 32"
GroupOption = Annotated[str, typer.Option(help=GROUP_HELP)]
CalibDataOption = Annotated[str | None, typer.Option(  # a str: typer would take "" (an unset variable) as "."
    metavar="PATH[:COLUMN]",
    help="Text/JSONL file, directory of them, parquet/arrow/csv file or a local HF datasets directory; chat "
         "`messages` rows are rendered with the chat template; PATH:COLUMN picks the column (default: built-in "
         "corpus)")]
CalibSizeOption = Annotated[int, typer.Option(min=1, help="Calibration samples")]
CalibLenOption = Annotated[int, typer.Option(min=LEAST_CALIB_SEQ_LEN, help="Tokens per calibration sample")]
ExcludeOption = Annotated[list[str] | None, typer.Option(
    metavar="PATTERN", help="Module name pattern to keep unquantized (repeatable)")]
LM_HEAD_HELP = ("lm_head weights: float | int8 (a scale per row) | int4 (groups of 64, whatever --group-size) "
                "(rounded to nearest at build; a tied embedding reads them too)")
LmHeadOption = Annotated[str, typer.Option(help=LM_HEAD_HELP)]
# build: None = not passed (refused without --quant), then the defaults above
BuildGroupOption = Annotated[str | None, typer.Option(help=f"{GROUP_HELP} (default auto)")]
BuildCalibSizeOption = Annotated[int | None, typer.Option(
    min=1, help=f"Calibration samples (default {DEFAULT_CALIB_SIZE})")]
BuildCalibLenOption = Annotated[int | None, typer.Option(
    min=LEAST_CALIB_SEQ_LEN, help=f"Tokens per calibration sample (default {DEFAULT_CALIB_SEQ_LEN})")]
BuildLmHeadOption = Annotated[str | None, typer.Option(help=f"{LM_HEAD_HELP} (default float)")]


def _at_most(most: int) -> Callable[[int | None], int | None]:
    """A flag's upper bound, checked as typer checks its lower one (a usage error) and stated in its help: typer's
    own `max` would widen every help's option column."""
    def check(value: int | None) -> int | None:
        if value is not None and value > most:
            raise typer.BadParameter(f"{value} is more than {most}, the most a step takes")
        return value
    return check


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise typer.BadParameter(f"{value} is not a power of two")
    return value


@app.command()
def build(
    model: Annotated[Path, typer.Option(help="Hugging Face checkpoint directory")],
    output: Annotated[Path, typer.Option(help="Engine directory to write")],
    target: Annotated[str, typer.Option(help="onnxruntime (CPU) | tensorrt | tensorrt-rtx")] = "onnxruntime",
    dtype: Annotated[str, typer.Option(
        help="auto (onnxruntime: float32; tensorrt targets: the checkpoint's own float16 or bfloat16 where the GPU "
             "has it, else float16) | float32 | float16 | bfloat16 (tensorrt, sm80+)")]
    = "auto",
    max_batch_size: Annotated[int, typer.Option(
        min=1, callback=_at_most(MOST_SEQUENCES), help=f"Most sequences in one step (at most {MOST_SEQUENCES})")]
    = 32,
    max_seq_len: Annotated[int | None, typer.Option(
        min=2, help="Most tokens per sequence, prompt + output (default: the model's context, at most 4096: "
                    "max_position_embeddings, or what its rope scaling extends it to)")] = None,
    max_num_tokens: Annotated[int, typer.Option(
        min=1, callback=_at_most(MOST_STEP_TOKENS),
        help=f"Most tokens in one step (prefill chunk size; at most {MOST_STEP_TOKENS})")] = 512,
    kv_block_size: Annotated[int, typer.Option(min=1, callback=_power_of_two,
                                               help="Tokens per KV cache block (a power of two, at most "
                                                    "32 or --max-seq-len rounded up to one)")] = 32,
    gpu_arch: Annotated[str | None, typer.Option(help="tensorrt targets: GPU architecture, e.g. sm89 (default: "
                                                      "tensorrt-rtx sm89, tensorrt the local GPU's)")] = None,
    quant: Annotated[str | None, typer.Option(
        help=f"{' | '.join(FORMATS)}: quantize first, as `camshaft quantize --quant` does (the quantized checkpoint "
             "is kept in OUTPUT.ckpt)")] = None,
    kv_cache_dtype: KVDtypeOption = None,
    group_size: BuildGroupOption = None,
    calib_data: CalibDataOption = None,
    calib_size: BuildCalibSizeOption = None,
    calib_seq_len: BuildCalibLenOption = None,
    exclude: ExcludeOption = None,
    lm_head: BuildLmHeadOption = None,
    weight_only_compute: Annotated[str, typer.Option(
        help="onnxruntime target, weight-only layers (int8_wo, int4_wo, int4_awq; int8_sq_mixed's down_proj): int8 "
             "(inputs quantized to int8 per block on the fly: faster, a small extra error, and outputs that can "
             "change with what a request is batched with) | float (exact dequantized weights) | auto (= int8)")]
    = "auto",
) -> None:
    """Build an engine directory from a Hugging Face checkpoint (with --quant: quantize it first)."""
    from dataclasses import replace

    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig
    from camshaft.outdir import replace_dir, staged, sync_tree

    output = Path(os.path.abspath(output))  # "." is gone from under the shell once replaced
    config = BuildConfig(model, output, target=target, dtype=dtype, max_batch_size=max_batch_size,
                         max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, kv_block_size=kv_block_size,
                         gpu_arch=gpu_arch, weight_only_compute=weight_only_compute)
    if quant is None:
        _refuse_quant_options(model, {"--kv-cache-dtype": kv_cache_dtype, "--group-size": group_size,
                                      "--calib-data": calib_data, "--calib-size": calib_size,
                                      "--calib-seq-len": calib_seq_len, "--exclude": exclude or None,
                                      "--lm-head": lm_head})
        manifest = build_engine(config, progress=progress)
    else:
        group_size = "auto" if group_size is None else group_size
        lm_head = "float" if lm_head is None else lm_head
        _check_quantized_build(config, quant, kv_cache_dtype, group_size, lm_head)
        checkpoint = quantized_checkpoint(output)
        with staged(checkpoint) as pending:  # kept as OUTPUT.ckpt once the engine built from it is in place
            _quantize(model, quant, pending, kv_cache_dtype, group_size, calib_data,
                      DEFAULT_CALIB_SIZE if calib_size is None else calib_size,
                      DEFAULT_CALIB_SEQ_LEN if calib_seq_len is None else calib_seq_len, exclude, lm_head,
                      shown_as=checkpoint)
            sync_tree(pending)  # on disk before the engine moves in: between the two, only renames
            manifest = build_engine(replace(config, model_dir=pending), progress=progress)
            replace_dir(pending, checkpoint)
    quant = manifest.quantization or {}
    quantized = quant.get("format") or quant.get("quant_algo") or (f"KV cache {quant['kv_cache_dtype']}"
                                                                   if quant.get("kv_cache_dtype") else None)
    err.print(f"built {manifest.model.architecture} engine for {manifest.target} ({manifest.dtype}"
              f"{', ' + quantized if quantized else ''}) in {manifest.target_options.get('build_seconds', '?')} s")
    typer.echo(str(output))


def quantized_checkpoint(output: Path) -> Path:
    """Where `build --quant` keeps the quantized checkpoint it builds from: OUTPUT.ckpt beside the engine."""
    output = Path(os.path.abspath(output))
    return output.with_name(output.name + ".ckpt")


def _refuse_quant_options(model: Path, options: dict[str, object]) -> None:
    """Without --quant, the quantization options the user passed would be ignored: refuse them."""
    from camshaft.model_config import HF_QUANT_CONFIG

    passed = [name for name, value in options.items() if value is not None]
    if passed:
        what = "is a quantization option" if len(passed) == 1 else "are quantization options"
        them = "it" if len(passed) == 1 else "them"
        if (model / HF_QUANT_CONFIG).is_file():  # its scales were calibrated with its own options
            raise CamshaftError(f"{', '.join(passed)} {what}, and {model} is already quantized: quantize the "
                                f"original float checkpoint again with {them} (camshaft build --quant FORMAT ... or "
                                f"camshaft quantize), or drop {them}")
        raise CamshaftError(f"{', '.join(passed)} {what}: add --quant FORMAT to quantize first, or drop {them}")


def _check_quantized_build(config: BuildConfig, quant: str, kv_cache_dtype: str | None, group_size: str,
                           lm_head: str) -> None:
    """Everything the build after quantizing would refuse, checked before calibration starts."""
    from camshaft.builder.target_checks import (
        check_lm_head_target,
        check_model_dtype,
        check_model_target,
        check_quantized_target,
        check_target,
        check_weight_only_compute,
    )
    from camshaft.builder.targets.trt_product import parse_arch
    from camshaft.engine_files import MANIFEST_NAME, engine_entries, refuse_user_entries
    from camshaft.errors import BuildConfigError
    from camshaft.model_config import HF_QUANT_CONFIG, ModelConfig
    from camshaft.outdir import check_replaceable
    from camshaft.quantize.modelopt_adapter import written_files
    from camshaft.quantize.spec import QuantSpec
    from camshaft.weight_files import stored_float_dtype

    spec = QuantSpec(quant, kv_cache_dtype=kv_cache_dtype, group_size=group_size, lm_head=lm_head)
    check_replaceable(config.output_dir, MANIFEST_NAME, "an engine", BuildConfigError,
                      owned=engine_entries)
    refuse_user_entries(config.output_dir)
    check_replaceable(quantized_checkpoint(config.output_dir), HF_QUANT_CONFIG, "a quantized checkpoint",
                      BuildConfigError, flag="the quantized checkpoint --quant keeps beside --output,",
                      owned=written_files)
    gpu_arch = check_target(config)
    if Path(config.model_dir).is_dir():  # a missing one: quantize says so
        model = ModelConfig.from_hf_dir(config.model_dir)
        check_model_target(config.target, model, quantized=True)  # Gemma 2 or a MoE on TensorRT: before calibrating
        check_model_dtype(model, config.resolved_dtype(stored_float_dtype(config.model_dir),
                                                       parse_arch(gpu_arch) if gpu_arch else None, model.architecture))
        config.resolved_max_seq_len(model)
    for algo in spec.info.layer_algos:
        check_quantized_target(config.target, algo, kv_cache_dtype and kv_cache_dtype.upper(), gpu_arch=gpu_arch,
                               shown_as=f"--quant {quant}")
    check_lm_head_target(config.target, lm_head, gpu_arch, "keep the head float (--lm-head float, the default)")
    check_weight_only_compute(config.weight_only_compute, spec.info.layer_algos, f"--quant {quant}")


def _quantize(model: Path, quant: str, output: Path, kv_cache_dtype: str | None, group_size: str,
              calib_data: str | None, calib_size: int, calib_seq_len: int, exclude: list[str] | None,
              lm_head: str = "float", shown_as: Path | None = None) -> None:
    """`shown_as`: the name progress and errors give `output` (build --quant's staging: the checkpoint it becomes)."""
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantizeError, QuantSpec

    def shown(text: str, kept: str = "") -> str:
        return text if shown_as is None else text.replace(str(output), f"{shown_as}{kept}")

    spec = QuantSpec(quant, kv_cache_dtype=kv_cache_dtype, group_size=group_size, exclude=tuple(exclude or ()),
                     lm_head=lm_head)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # ModelOpt prints; stdout carries only the output path
            result = quantize_checkpoint(model, output, spec, calib_data=calib_data, calib_size=calib_size,
                                         calib_seq_len=calib_seq_len,
                                         progress=lambda m: progress(shown(m, " (once the engine is built)")),
                                         progress_bar=True)
    except QuantizeError as exc:
        raise QuantizeError(shown(str(exc))) from exc
    err.print(f"quantized to {spec.format}" + (f" (group {result.group_size})" if result.group_size else "")
              + f" in {result.seconds['total']} s")


@app.command()
def quantize(
    model: Annotated[Path, typer.Option(help="Hugging Face checkpoint directory (float)")],
    quant: QuantOption,
    output: Annotated[Path, typer.Option(help="Quantized checkpoint directory to write")],
    kv_cache_dtype: KVDtypeOption = None,
    group_size: GroupOption = "auto",
    calib_data: CalibDataOption = None,
    calib_size: CalibSizeOption = DEFAULT_CALIB_SIZE,
    calib_seq_len: CalibLenOption = DEFAULT_CALIB_SEQ_LEN,
    exclude: ExcludeOption = None,
    lm_head: LmHeadOption = "float",
) -> None:
    """Calibrate and quantize a checkpoint with NVIDIA ModelOpt into a quantized (unified HF) checkpoint."""
    output = Path(os.path.abspath(output))
    _quantize(model, quant, output, kv_cache_dtype, group_size, calib_data, calib_size, calib_seq_len, exclude,
              lm_head)
    typer.echo(str(output))


