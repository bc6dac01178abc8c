"""The onnxruntime target's second graph: one sequence at a time (builder/graph/sequence.py), beside the batch graph."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import helper

from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.graph.decoder import OPSET
from camshaft.builder.graph.head import Head
from camshaft.builder.graph.linear import MS_DOMAIN, Linears
from camshaft.builder.graph.ops import GraphWriter, Reuse, save_model, weights_file
from camshaft.builder.graph.sequence import SequenceLowering, sequence_layout
from camshaft.graph_meta import graph_limits, sequence_graph_support
from camshaft.io_signature import SequenceGraph
from camshaft.manifest import BuildLimits

SEQUENCE_ARTIFACT = "sequence.onnx"

Progress = Callable[[str], None]


def sequence_graph(checkpoint: Checkpoint, limits: BuildLimits, dtype: str, staging: Path, progress: Progress,
                   accuracy_level: int, batch_artifact: str) -> SequenceGraph | None:
    """The onnxruntime target's single-sequence graph beside the batch graph `batch_artifact` (already compiled in
    `staging`), sharing its weights; None (said) when the checkpoint cannot have one."""
    reason = sequence_graph_support(checkpoint.config, dtype, checkpoint.kv_cache_dtype)
    if reason is not None:
        progress(f"no sequence graph: {reason}; the Session will run the batch graph")
        return None
    progress("writing the sequence graph (one sequence at a time, for Session)")
    head = "stored" if checkpoint.quantizes_head else checkpoint.lm_head  # not a float head's screen
    layout = sequence_layout(checkpoint.config, limits, SEQUENCE_ARTIFACT, head)
    batch = staging / batch_artifact
    with open(batch.with_name(batch.name + ".data"), "rb") as batch_data:
        shared = BatchWeights(batch, batch_data)
        write_sequence_graph(checkpoint, limits, staging, layout, progress, accuracy_level, shared.find)
    progress(f"sequence graph: {shared.bytes / 1e6:.0f} MB of its weights are the batch graph's, stored once")
    return layout


class BatchWeights:
    """The batch artifact's external tensors: a sequence-graph weight with the same name and bytes points at one of
    them instead of being written again. The graph stays as written (not ORT-optimised: ONNX Runtime optimises it at
    load, folding its gate/up Concats)."""

    def __init__(self, artifact: Path, data: BinaryIO) -> None:
        model = onnx.load(str(artifact), load_external_data=False)
        self.data, self.location = data, artifact.name + ".data"
        self.where = {t.name: _location(t) for t in model.graph.initializer
                      if t.data_location == onnx.TensorProto.EXTERNAL}
        self.bytes = 0

    def find(self, name: str, raw: bytes) -> tuple[str, int] | None:
        match = self.where.get(name)
        if match is None or match[0] != self.location or match[2] != len(raw):
            return None
        self.data.seek(match[1])
        if self.data.read(len(raw)) != raw:
            return None
        self.bytes += len(raw)
        return self.location, match[1]


def _location(tensor: onnx.TensorProto) -> tuple[str, int, int]:
    entries = {e.key: e.value for e in tensor.external_data}
    return entries["location"], int(entries.get("offset", 0)), int(entries["length"])


def write_sequence_graph(checkpoint: Checkpoint, limits: BuildLimits, out_dir: Path, layout: SequenceGraph,
                         progress: Progress = lambda _: None, accuracy_level: int | None = None,
                         reuse: Reuse | None = None) -> Path:
    """The single-sequence graph (sequence.py) as `layout.artifact` in `out_dir`, its weights in that file's .data
    (those `reuse` finds elsewhere are not written)."""
    path = out_dir / layout.artifact
    quantized = checkpoint.quantized_linear if checkpoint.quantization is not None else None
    with weights_file(path.with_name(path.name + ".data")) as data:
        writer = GraphWriter(data, path.name + ".data", reuse)
        linears = Linears(writer, np.dtype(np.float32), checkpoint.get, quantized, accuracy_level)
        head = Head(linears, checkpoint.config, checkpoint.lm_head, checkpoint.lm_head_float_channels)
        SequenceLowering(writer, checkpoint.config, limits, linears, head, checkpoint.get, layout,
                         progress).lower()
    model = writer.model(OPSET)
    model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    helper.set_model_props(model, graph_limits(limits, batch_graph=False))
    save_model(model, path)
    return path
