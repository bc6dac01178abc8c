"""The onnxruntime target: saves the ORT-optimised graph so that loading an engine is fast."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnxruntime as ort

from camshaft.errors import BuildConfigError

ARTIFACT = "model.onnx"
ARTIFACT_DATA = "model.onnx.data"


def graph_bytes(graph_path: Path) -> int:
    return sum(p.stat().st_size for p in graph_path.parent.glob(graph_path.name + "*"))


def compile_graph(graph_path: Path, engine_dir: Path) -> dict[str, object]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(engine_dir / ARTIFACT)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", ARTIFACT_DATA)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    options.intra_op_num_threads = 1
    try:
        ort.InferenceSession(str(graph_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own untyped errors
        free = shutil.disk_usage(engine_dir).free
        raise BuildConfigError(f"ONNX Runtime could not compile the graph into {engine_dir} ({exc}); "
                               f"{free / 1e6:.0f} MB are free there" + (": free some space or choose another --output"
                                                                        if free < 2 * graph_bytes(graph_path) else "")
                               ) from exc
    return {"optimization_level": "extended", "onnxruntime": ort.__version__}
