"""The onnxruntime target's second graph: one sequence at a time (builder/graph/sequence.py), beside the batch graph."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from onnx import helper

from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.graph.decoder import OPSET
from camshaft.builder.graph.head import Head
from camshaft.builder.graph.linear import MS_DOMAIN, Linears
from camshaft.builder.graph.ops import GraphWriter, save_model
from camshaft.builder.graph.sequence import SequenceLowering, sequence_graph_support, sequence_layout
from camshaft.manifest import BuildLimits, SequenceGraph

SEQUENCE_GRAPH = "sequence_graph.onnx"
SEQUENCE_ARTIFACT = "sequence.onnx"

Progress = Callable[[str], None]


def sequence_graph(checkpoint: Checkpoint, limits: BuildLimits, dtype: str, staging: Path, progress: Progress,
                    accuracy_level: int) -> SequenceGraph | None:
    """The onnxruntime target's single-sequence graph, compiled beside the batch graph; None (said) when the
    checkpoint cannot have one."""
    reason = sequence_graph_support(checkpoint.config, dtype, checkpoint.kv_cache_dtype)
    if reason is not None:
        progress(f"no sequence graph: {reason}; the Session will run the batch graph")
        return None
    from camshaft.builder.targets import onnxruntime as ort_target

    progress("writing the sequence graph (one sequence at a time, for Session)")
    graph_path, layout = write_sequence_graph(checkpoint, limits.max_seq_len, staging, progress, accuracy_level)
    ort_target.compile_graph(graph_path, staging, layout.artifact)
    graph_path.unlink()
    (staging / f"{SEQUENCE_GRAPH}.data").unlink()
    return layout


def write_sequence_graph(checkpoint: Checkpoint, max_seq_len: int, out_dir: Path, progress: Progress = lambda _: None,
                         accuracy_level: int | None = None) -> tuple[Path, SequenceGraph]:
    """The single-sequence graph (sequence.py) for a checkpoint the batch graph was just written for."""
    graph_path = out_dir / SEQUENCE_GRAPH
    quantized = checkpoint.quantized_linear if checkpoint.quantization is not None else None
    layout = sequence_layout(checkpoint.config, SEQUENCE_ARTIFACT)
    with open(out_dir / f"{SEQUENCE_GRAPH}.data", "wb") as data:
        writer = GraphWriter(data, f"{SEQUENCE_GRAPH}.data")
        linears = Linears(writer, np.dtype(np.float32), checkpoint.get, quantized, accuracy_level)
        head = Head(linears, checkpoint.config, checkpoint.lm_head)
        SequenceLowering(writer, checkpoint.config, max_seq_len, linears, head, checkpoint.get, layout,
                         progress).lower()
    model = writer.model(OPSET)
    model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    save_model(model, graph_path)
    return graph_path, layout
