"""The onnxruntime target: saves the ORT-optimised graph so that loading an engine is fast."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

ARTIFACT = "model.onnx"
ARTIFACT_DATA = "model.onnx.data"


def compile_graph(graph_path: Path, engine_dir: Path) -> dict[str, object]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(engine_dir / ARTIFACT)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", ARTIFACT_DATA)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    options.intra_op_num_threads = 1
    ort.InferenceSession(str(graph_path), options, providers=["CPUExecutionProvider"])
    return {"optimization_level": "extended", "onnxruntime": ort.__version__}
