"""checkpoint → model graph → compiled artifact → engine directory, written atomically."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.config import ACCURACY_LEVELS, BuildConfig
from camshaft.builder.engine_tokenizer import save_tokenizer
from camshaft.builder.graph.decoder import OPSET, DecoderLowering, kv_layout, step_inputs
from camshaft.builder.graph.linear import MS_DOMAIN
from camshaft.builder.graph.ops import GraphWriter, save_model, weights_file
from camshaft.builder.quant_record import quantization_record
from camshaft.builder.sequence_graph import sequence_graph
from camshaft.builder.target_checks import (
    check_lm_head_target,
    check_model_dtype,
    check_model_target,
    check_quantized_target,
    check_target,
    check_weight_only_compute,
    has_weight_only_layers,
)
from camshaft.builder.targets.trt_product import parse_arch
from camshaft.engine_files import (
    CHAT_TEMPLATE,
    TOKENIZER_DIR,
    engine_entries,
    record_files,
    record_template,
    refuse_user_entries,
)
from camshaft.errors import BuildConfigError
from camshaft.graph_meta import BUILD_ID_KEY, graph_limits
from camshaft.io_signature import TensorSpec
from camshaft.manifest import MANIFEST_NAME, BuildLimits, Manifest, content_id
from camshaft.outdir import check_replaceable, replace_dir, staged
from camshaft.version import __version__

GRAPH_NAME = "graph.onnx"
GRAPH_DATA = "graph.onnx.data"

Progress = Callable[[str], None]


def write_graph(checkpoint: Checkpoint, limits: BuildLimits, dtype: str, out_dir: Path,
                progress: Progress = lambda _: None, quantization: dict | None = None, qdq: bool = False,
                accuracy_level: int | None = None, branches: bool = False, grouped_decode: bool = False) -> Path:
    """The portable model graph (standard ONNX ops, external weights) for a checkpoint.
    Weight-only quantized layers become com.microsoft MatMulNBits (ONNX Runtime), W8A8 and FP8 layers and a quantized
    KV cache Q/DQ nodes; with `qdq` (the TensorRT targets) every quantized layer is standard Q/DQ. `quantization`
    receives what was lowered. `accuracy_level`: MatMulNBits' (weight-only layers; default 0, float compute).
    `branches` (the onnxruntime target): each attention group sits in an If, so a step skips a group it has no
    sequences for (the TensorRT targets compute it on a one-token dummy). `grouped_decode` (the onnxruntime target):
    decode attention with the query heads that share a K/V head as rows of one head (TensorRT's attention kernels
    refuse that shape)."""
    graph_path = out_dir / GRAPH_NAME
    quantized = checkpoint.quantized_linear if checkpoint.quantization is not None else None
    kv_dtype = checkpoint.kv_cache_dtype
    kv_cache = (kv_dtype, checkpoint.kv_scales, checkpoint.kv_biases) if kv_dtype else None
    with weights_file(out_dir / GRAPH_DATA) as data:
        writer = GraphWriter(data, GRAPH_DATA)
        lowering = DecoderLowering(writer, checkpoint.config, limits, dtype, checkpoint.get, progress,
                                   quantized=quantized, accuracy_level=accuracy_level,
                                   kv_cache=kv_cache,
                                   qdq=qdq, lm_head=checkpoint.lm_head,
                                   lm_head_float_channels=checkpoint.lm_head_float_channels, branches=branches,
                                   grouped_decode=grouped_decode)
        with np.errstate(over="ignore"):  # a float16 cast past its range: GraphWriter.weight refuses it, by name
            lowering.lower()
    dequantized = lowering.linears.dequantized
    if dequantized:
        more = " ..." if len(dequantized) > 3 else ""
        progress(f"{len(dequantized)} quantized layer(s) no kernel of this target takes, built from their dequantized "
                 f"weights (float compute, exact): {', '.join(dequantized[:3])}{more}")
    model = writer.model(OPSET)
    if MS_DOMAIN in _domains(model.graph):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    helper.set_model_props(model, graph_limits(limits, batch_graph=True))
    if quantization is not None and checkpoint.quantization is not None:
        quantization.update(quantization_record(checkpoint.quantization, checkpoint.quant_algos, lowering))
    save_model(model, graph_path)
    return graph_path


def _domains(graph: onnx.GraphProto) -> set[str]:
    """Operator domains of a graph and of the branches inside it."""
    found = {node.domain for node in graph.node}
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found |= _domains(attr.g)
    return found


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_engine(config: BuildConfig, progress: Progress = lambda _: None) -> Manifest:
    output = Path(os.path.abspath(config.output_dir))  # "." is gone from under the shell once replaced
    check_replaceable(output, MANIFEST_NAME, "an engine", BuildConfigError, owned=engine_entries)
    refuse_user_entries(output)
    gpu_arch = check_target(config)
    started = time.perf_counter()
    with Checkpoint(config.model_dir) as checkpoint:
        model = checkpoint.config
        check_model_target(config.target, model, checkpoint.quantization is not None)
        if checkpoint.unused:
            shown = ", ".join(checkpoint.unused[:4]) + (", ..." if len(checkpoint.unused) > 4 else "")
            progress(f"note: {len(checkpoint.unused)} stored tensor(s) that config.json leaves unread (transformers "
                     f"ignores them too): {shown}; if the model uses them, correct config.json (num_hidden_layers, "
                     "attention_bias, mlp_bias, ...)")
        algos = checkpoint.quant_algos
        for algo in algos or ([None] if checkpoint.quantization else []):  # None: a KV cache quantized alone
            check_quantized_target(config.target, algo, checkpoint.quantization.get("kv_cache_quant_algo"), gpu_arch)
        check_lm_head_target(config.target, checkpoint.lm_head, gpu_arch, "quantize the checkpoint again with "
                             "--lm-head float (the default)")
        check_weight_only_compute(config.weight_only_compute, algos, str(config.model_dir))
        # int8 compute by default only where the checkpoint has weight-only layers (an int4 lm_head on an fp8 /
        # int8_sq checkpoint keeps float compute, as before the option existed)
        accuracy_level = config.accuracy_level if has_weight_only_layers(algos) else ACCURACY_LEVELS["float"]
        quantization: dict = {}
        limits = BuildLimits(
            max_batch_size=config.max_batch_size,
            max_seq_len=config.resolved_max_seq_len(model),
            max_num_tokens=config.max_num_tokens,
            kv_block_size=config.kv_block_size,
        )
        dtype = config.resolved_dtype(checkpoint.float_dtype, parse_arch(gpu_arch) if gpu_arch else None,
                                      model.architecture)
        check_model_dtype(model, dtype)
        tokenizer_files = checkpoint.tokenizer_files()  # before any long work: a checkpoint without one fails now
        with staged(output) as staging:
            tok_dir = staging / TOKENIZER_DIR  # first: a tokenizer that cannot load fails before any long work
            tok_dir.mkdir()
            for file in tokenizer_files:  # not the checkpoint's modes: the engine's files are made as its graph's
                shutil.copyfile(file, tok_dir / file.name)
            save_tokenizer(checkpoint.dir, tok_dir, model.vocab_size, progress)
            record_template(tok_dir)
            progress("writing model graph")
            for_ort = config.target == "onnxruntime"
            graph_path = write_graph(checkpoint, limits, dtype, staging, progress, quantization,
                                     qdq=not for_ort, accuracy_level=accuracy_level, branches=for_ort,
                                     grouped_decode=for_ort)
            graph_hash = file_sha256(graph_path)
            progress(f"compiling for {config.target}")
            artifact, files, target_options = _compile(config, limits, graph_path, staging, progress, gpu_arch)
            sequence = None
            if for_ort:
                sequence = sequence_graph(checkpoint, limits, dtype, staging, progress, accuracy_level, artifact)
                files += [sequence.artifact, f"{sequence.artifact}.data"] if sequence else []
            import onnxruntime

            files += sorted(f"{TOKENIZER_DIR}/{p.name}" for p in tok_dir.iterdir()  # the chat template: editable
                            if p.is_file() and p.name != CHAT_TEMPLATE)
            progress("hashing the engine's files")
            draft = Manifest(
                model=model,
                limits=limits,
                dtype=dtype,
                target=config.target,
                artifact=artifact,
                inputs=step_inputs(model, limits, branches=for_ort),
                outputs=(TensorSpec("logits", "float32", ("N", model.vocab_size)),),
                kv_cache=kv_layout(model, limits, checkpoint.kv_cache_dtype or dtype),
                quantization=quantization,
                tools={"camshaft": __version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                       **target_options.pop("tools", {})},
                files={name: (staging / name).stat().st_size for name in files},
                fingerprints={name: file_sha256(staging / name) for name in files},  # whole: the id's content
                build_id="-",
                graph_sha256=graph_hash,
                sequence_graph=sequence,
                target_options=target_options,
            )
            build_id = content_id(draft)  # equal builds share it: what an engine holds, for caches and audits
            for graph in [artifact, sequence.artifact if sequence else None] if for_ort else []:
                if graph is not None:
                    stamp_build_id(staging / graph, build_id)
            sizes, fingerprints = record_files(staging, files)
            seconds = round(time.perf_counter() - started, 2)
            manifest = replace(draft, files=sizes, fingerprints=fingerprints, build_id=build_id,
                               target_options={**target_options, "build_seconds": seconds})
            manifest.write(staging)
            replace_dir(staging, output)
    progress(f"engine written to {output}")
    return manifest


def stamp_build_id(path: Path, build_id: str) -> None:
    """The build's id in an onnxruntime graph's metadata (graph_meta.check_build_id); its weights stay put."""
    model = onnx.load(str(path), load_external_data=False)
    model.metadata_props.append(onnx.StringStringEntryProto(key=BUILD_ID_KEY, value=build_id))
    onnx.save(model, str(path))


def _compile(config: BuildConfig, limits: BuildLimits, graph_path: Path, staging: Path,
             progress: Progress, gpu_arch: str | None) -> tuple[str, list[str], dict]:
    if config.target == "onnxruntime":
        from camshaft.builder.targets import onnxruntime as ort_target

        options = ort_target.compile_graph(graph_path, staging)
        graph_path.unlink()
        (staging / GRAPH_DATA).unlink()
        return ort_target.ARTIFACT, [ort_target.ARTIFACT, ort_target.ARTIFACT_DATA], options
    from camshaft.builder.targets import tensorrt, trt_product, trt_support

    # The published operator matrix first: a clear list of offending nodes instead of a parser failure.
    trt_support.require_supported(graph_path, config.target, trt_product.import_product(config.target).__version__,
                                  gpu_arch=trt_product.parse_arch(gpu_arch))  # check_target's architecture
    num_blocks_max = limits.max_batch_size * limits.max_blocks_per_seq + 1
    meta = tensorrt.build_plan(graph_path, staging / tensorrt.ARTIFACT, product=config.target, gpu_arch=gpu_arch,
                               limits=limits, num_blocks_max=num_blocks_max, progress=progress)
    meta["tools"] = {meta["product"]: meta["version"]}
    # The graph the plan was built from stays beside it: its hash is in the manifest.
    return tensorrt.ARTIFACT, [tensorrt.ARTIFACT, GRAPH_NAME, GRAPH_DATA], meta
