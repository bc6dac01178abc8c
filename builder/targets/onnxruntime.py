"""The onnxruntime target: saves the ORT-optimised graph so that loading an engine is fast."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnxruntime as ort

from camshaft.engine_files import graph_bytes
from camshaft.errors import BuildConfigError

ARTIFACT = "model.onnx"
ARTIFACT_DATA = "model.onnx.data"


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
        if isinstance(exc, MemoryError) or "bad_alloc" in str(exc):
            raise MemoryError(f"ONNX Runtime ran out of memory compiling the graph ({exc})") from exc
        where, free, need = engine_dir.parent, shutil.disk_usage(engine_dir).free, graph_bytes(graph_path)
        short = f"; the compiled graph needs about {need / 1e6:.0f} MB in {where} and {free / 1e6:.0f} MB were " \
                "left there: free some space or choose another --output" if free < need else ""
        raise BuildConfigError(f"ONNX Runtime could not compile the graph ({exc}){short}") from exc
    return {"optimization_level": "extended", "onnxruntime": ort.__version__}
