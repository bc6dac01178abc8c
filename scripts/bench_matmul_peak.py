"""The machine's fp32 matmul peak (ONNX Runtime, torch and numpy) and a decode step's ceiling: 32-row matmuls over
weights too large for the caches, each read from memory once, as a model's layers are."""

from __future__ import annotations

import statistics
import time

import numpy as np


def best_of(first: dict, second: dict) -> dict:
    """Two peak measurements (before and after the runs: this machine's speed drifts) merged, best per shape."""
    out = {k: max(first["gflop_s"][k], second["gflop_s"][k]) for k in first["gflop_s"]}
    best = max(out, key=out.get)
    return {**first, "gflop_s": out, "peak_gflop_s": out[best], "peak_shape": best}


def sgemm_peak(threads: int, repeats: int = 7) -> dict:
    """fp32 matmul GFLOP/s on `threads` threads, ONNX Runtime's MatMul (the engine's kernel, weight as an
    initializer), torch.mm and numpy (its BLAS), for the model's MLP shape at a full prefill step (512 tokens) and a
    decode step (32 tokens), and square 1024 and 2048 matmuls; median of `repeats` timings per shape; the best is
    the peak."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper, numpy_helper

    torch.set_num_threads(threads)
    shapes = {"512x576·576x1536 (prefill step, MLP up)": (512, 576, 1536),
              "32x576·576x1536 (decode step, MLP up)": (32, 576, 1536),
              "1024³": (1024, 1024, 1024), "2048³": (2048, 2048, 2048)}
    rng = np.random.default_rng(0)

    def ort_matmul(k: int, b: np.ndarray):
        graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "mm",
                                  [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                                  [numpy_helper.from_array(b, "b")])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(helper.make_model(graph).SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        return lambda a, _b: session.run(None, {"a": a})

    out = {}
    for lib in ("onnxruntime", "torch", "numpy"):
        for name, (m, k, n) in shapes.items():
            a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
            if lib == "torch":
                a, b, mm = torch.from_numpy(a), torch.from_numpy(b), torch.mm
            else:
                mm = ort_matmul(k, b) if lib == "onnxruntime" else np.matmul
            inner = max(1, int(2e9 / (2 * m * k * n)))  # about 2 GFLOP a timing
            mm(a, b)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(inner):
                    mm(a, b)
                times.append((time.perf_counter() - t0) / inner)
            out[f"{lib} {name}"] = round(2 * m * k * n / statistics.median(times) / 1e9, 1)
    best = max(out, key=out.get)
    return {"gflop_s": out, "peak_gflop_s": out[best], "peak_shape": best, "threads": threads,
            "numpy_threads": "its BLAS default: every available core"}


def streamed_matmul(threads: int, weight_bytes: int, rows: int = 32, dim: int = 576, repeats: int = 7) -> dict:
    """GFLOP/s of `rows`-row fp32 products over `weight_bytes` of distinct [dim, dim] weights chained in one ONNX
    Runtime graph: each weight is read once a run, from memory, as a decode step reads the model's layers (the
    peak above reuses one weight, which stays in the caches). The ceiling of a decode step's linear layers."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    count = max(1, weight_bytes // (dim * dim * 4))
    weights = [numpy_helper.from_array((rng.standard_normal((dim, dim)) * dim ** -0.5).astype(np.float32), f"w{i}")
               for i in range(count)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"y{i - 1}", f"w{i}"], [f"y{i}"]) for i in range(count)]
    graph = helper.make_graph(nodes, "streamed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, dim])],
                              [helper.make_tensor_value_info(f"y{count - 1}", TensorProto.FLOAT, None)], weights)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(helper.make_model(graph).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"gflop_s": round(2 * rows * dim * dim * count / seconds / 1e9, 1), "rows": rows,
            "weight_mb": round(count * dim * dim * 4 / 1e6), "gb_s": round(count * dim * dim * 4 / seconds / 1e9, 1)}
