"""Commands that make things: models fetch, build (with --quant), quantize."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer

from camshaft.cli import app, err, models_app, progress
from camshaft.errors import CamshaftError
from camshaft.quantize.spec import FORMATS


@models_app.command("fetch")
def models_fetch(
    name: Annotated[str, typer.Argument(help="Model name, e.g. smollm2-135m-instruct")],
    output: Annotated[Path | None, typer.Option(help="Checkpoint directory (default: the camshaft cache)")] = None,
) -> None:
    """Fetch a known model and convert it to a Hugging Face checkpoint directory."""
    from camshaft.models import default_model_dir, fetch_model

    path = fetch_model(name, output or default_model_dir(name), progress=progress)
    typer.echo(str(path))


QuantOption = Annotated[str, typer.Option(help=" | ".join(FORMATS))]
KVDtypeOption = Annotated[str | None, typer.Option(help="Also quantize the KV cache: fp8 | int8")]
GroupOption = Annotated[str, typer.Option(help="INT4 block size: auto | 128 | 64 | 32")]
CalibDataOption = Annotated[Path | None, typer.Option(help="Text/JSONL file or directory (default: built-in corpus)")]
CalibSizeOption = Annotated[int, typer.Option(help="Calibration samples")]
CalibLenOption = Annotated[int, typer.Option(help="Tokens per calibration sample")]
ExcludeOption = Annotated[list[str] | None, typer.Option(
    help="Module name pattern to keep unquantized (repeatable)")]
LmHeadOption = Annotated[str, typer.Option(
    help="lm_head weights: float | int8 | int4 (rounded to nearest at build; a tied embedding reads them too)")]


@app.command()
def build(
    model: Annotated[Path, typer.Option(help="Hugging Face checkpoint directory")],
    output: Annotated[Path, typer.Option(help="Engine directory to write")],
    target: Annotated[str, typer.Option(help="onnxruntime (CPU) | tensorrt | tensorrt-rtx")] = "onnxruntime",
    dtype: Annotated[str, typer.Option(
        help="auto (onnxruntime: float32, tensorrt targets: float16) | float32 | float16 | bfloat16 (tensorrt, sm80+)")]
    = "auto",
    max_batch_size: Annotated[int, typer.Option(help="Most sequences in one step")] = 32,
    max_seq_len: Annotated[int | None, typer.Option(help="Most tokens per sequence, prompt + output")] = None,
    max_num_tokens: Annotated[int, typer.Option(help="Most tokens in one step (prefill chunk size)")] = 512,
    kv_block_size: Annotated[int, typer.Option(help="Tokens per KV cache block")] = 32,
    gpu_arch: Annotated[str | None, typer.Option(help="tensorrt targets: GPU architecture, e.g. sm89")] = None,
    quant: Annotated[str | None, typer.Option(
        help="Quantize first, as `camshaft quantize --quant` does (the quantized checkpoint is kept in OUTPUT.ckpt)")]
    = None,
    kv_cache_dtype: KVDtypeOption = None,
    group_size: GroupOption = "auto",
    calib_data: CalibDataOption = None,
    calib_size: CalibSizeOption = 64,
    calib_seq_len: CalibLenOption = 256,
    exclude: ExcludeOption = None,
    lm_head: LmHeadOption = "float",
    weight_only_compute: Annotated[str, typer.Option(
        help="onnxruntime target, int8_wo/int4_wo/int4_awq layers: int8 (inputs quantized to int8 per block on the "
             "fly: faster, a small extra error) | float (exact dequantized weights) | auto (= int8)")] = "auto",
) -> None:
    """Build an engine directory from a Hugging Face checkpoint (with --quant: quantize it first)."""
    from dataclasses import replace

    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    config = BuildConfig(model, output, target=target, dtype=dtype, max_batch_size=max_batch_size,
                         max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, kv_block_size=kv_block_size,
                         gpu_arch=gpu_arch, weight_only_compute=weight_only_compute)
    if quant is None and (kv_cache_dtype is not None or calib_data is not None or exclude or lm_head != "float"):
        raise CamshaftError(
            "--kv-cache-dtype, --calib-data, --exclude and --lm-head are quantization options: add --quant")
    if quant is not None:
        from camshaft.builder.build import check_quantized_target, check_weight_only_compute
        from camshaft.quantize.spec import QuantSpec

        spec = QuantSpec(quant, kv_cache_dtype=kv_cache_dtype, group_size=group_size, lm_head=lm_head)
        for algo in spec.info.layer_algos:
            check_quantized_target(target, algo, kv_cache_dtype and kv_cache_dtype.upper(),
                                   gpu_arch=config.resolved_gpu_arch)
        check_weight_only_compute(weight_only_compute, spec.info.layer_algos, f"--quant {quant}")
        checkpoint = output.with_name(output.name + ".ckpt")
        _quantize(model, quant, checkpoint, kv_cache_dtype, group_size, calib_data, calib_size, calib_seq_len,
                  exclude, lm_head)
        config = replace(config, model_dir=checkpoint)
    manifest = build_engine(config, progress=progress)
    err.print(f"built {manifest.model.architecture} engine for {manifest.target} ({manifest.dtype}) in "
              f"{manifest.target_options.get('build_seconds', '?')} s")
    typer.echo(str(output))


def _quantize(model: Path, quant: str, output: Path, kv_cache_dtype: str | None, group_size: str,
              calib_data: Path | None, calib_size: int, calib_seq_len: int, exclude: list[str] | None,
              lm_head: str = "float") -> None:
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    spec = QuantSpec(quant, kv_cache_dtype=kv_cache_dtype, group_size=group_size, exclude=tuple(exclude or ()),
                     lm_head=lm_head)
    with contextlib.redirect_stdout(sys.stderr):  # ModelOpt prints; stdout carries only the output path
        result = quantize_checkpoint(model, output, spec, calib_data=calib_data, calib_size=calib_size,
                                     calib_seq_len=calib_seq_len, progress=progress, progress_bar=True)
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
    calib_size: CalibSizeOption = 64,
    calib_seq_len: CalibLenOption = 256,
    exclude: ExcludeOption = None,
    lm_head: LmHeadOption = "float",
) -> None:
    """Calibrate and quantize a checkpoint with NVIDIA ModelOpt into a quantized (unified HF) checkpoint."""
    _quantize(model, quant, output, kv_cache_dtype, group_size, calib_data, calib_size, calib_seq_len, exclude,
              lm_head)
    typer.echo(str(output))


