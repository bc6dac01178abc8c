"""The onnxruntime target's second graph: one sequence at a time (builder/graph/sequence.py), beside the batch graph."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
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
                   accuracy_level: int, batch_artifact: str) -> SequenceGraph | None:
    """The onnxruntime target's single-sequence graph beside the batch graph `batch_artifact` (already compiled in
    `staging`), sharing its weights; None (said) when the checkpoint cannot have one."""
    reason = sequence_graph_support(checkpoint.config, dtype, checkpoint.kv_cache_dtype)
    if reason is not None:
        progress(f"no sequence graph: {reason}; the Session will run the batch graph")
        return None
    progress("writing the sequence graph (one sequence at a time, for Session)")
    graph_path, layout = write_sequence_graph(checkpoint, limits.max_seq_len, staging, progress, accuracy_level)
    shared = share_weights(graph_path, staging / layout.artifact, staging / batch_artifact)
    progress(f"sequence graph: {shared / 1e6:.0f} MB of its weights are the batch graph's, stored once")
    graph_path.unlink()
    (staging / f"{SEQUENCE_GRAPH}.data").unlink()
    return layout


def share_weights(graph_path: Path, out_path: Path, batch_artifact: Path) -> int:
    """Save the graph as `out_path`, each external tensor pointing at the same tensor (name and bytes) in the batch
    artifact's data file where there is one, the others copied to `out_path`.data. The graph stays as written (not
    ORT-optimised: ONNX Runtime optimises it at load, folding its gate/up Concats). Returns the bytes shared."""
    batch = onnx.load(str(batch_artifact), load_external_data=False)
    batch_data = batch_artifact.with_name(batch_artifact.name + ".data")
    where = {t.name: _location(t) for t in batch.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    model = onnx.load(str(graph_path), load_external_data=False)
    own = out_path.with_name(out_path.name + ".data")
    shared = 0
    with open(graph_path.with_name(graph_path.name + ".data"), "rb") as source, open(batch_data, "rb") as other, \
            open(own, "wb") as data:
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            _, offset, length = _location(tensor)
            source.seek(offset)
            raw = source.read(length)
            match = where.get(tensor.name)
            if match is not None and match[0] == batch_data.name and match[2] == length:
                other.seek(match[1])
                if other.read(length) == raw:
                    _point(tensor, batch_data.name, match[1], length)
                    shared += length
                    continue
            data.write(b"\0" * (-data.tell() % 64))
            _point(tensor, own.name, data.tell(), length)
            data.write(raw)
    save_model(model, out_path)
    return shared


def _location(tensor: onnx.TensorProto) -> tuple[str, int, int]:
    entries = {e.key: e.value for e in tensor.external_data}
    return entries["location"], int(entries.get("offset", 0)), int(entries["length"])


def _point(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


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
