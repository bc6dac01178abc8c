"""Decode attention kernels of ONNX Runtime on the CPU, in isolation, with SmolLM2's head shapes.

ONNX Attention-23 (what the engine graph uses, K/V gathered to [B, L, kv_heads*dim]) against com.microsoft
GroupQueryAttention (what onnxruntime-genai uses, past K/V in [B, kv_heads, L, dim]); same inputs, same numerics.
Medians of interleaved calls in one process, 2 threads. Usage: python scripts/probe_attention_kernels.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # as camshaft does, before onnxruntime is imported

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

HQ, HKV, D = 9, 3, 64
CASES = [(1, 192), (32, 320)]  # batch-1 decode; a batch-32 serving step
F32 = TensorProto.FLOAT


def value(name: str, elem: int, shape: list | None) -> object:
    return helper.make_tensor_value_info(name, elem, shape)


def session(node, inputs: list, outputs: list, opsets: list[tuple[str, int]]) -> ort.InferenceSession:
    model = helper.make_model(helper.make_graph([node], "probe", inputs, outputs),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def attention_session() -> ort.InferenceSession:
    node = helper.make_node("Attention", ["q", "k", "v", "m"], ["y"], q_num_heads=HQ, kv_num_heads=HKV, scale=D**-0.5)
    inputs = [value("q", F32, ["B", 1, HQ * D]), value("k", F32, ["B", "L", HKV * D]),
              value("v", F32, ["B", "L", HKV * D]), value("m", TensorProto.BOOL, ["B", 1, 1, "L"])]
    return session(node, inputs, [value("y", F32, None)], [("", 23)])


def gqa_session() -> ort.InferenceSession:
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tl"], ["y", "ok", "ov"],
                            domain="com.microsoft", num_heads=HQ, kv_num_heads=HKV, scale=D**-0.5)
    inputs = [value("q", F32, ["B", 1, HQ * D]), value("k", F32, ["B", 1, HKV * D]), value("v", F32, ["B", 1, HKV * D]),
              value("pk", F32, ["B", HKV, "P", D]), value("pv", F32, ["B", HKV, "P", D]),
              value("sl", TensorProto.INT32, ["B"]), value("tl", TensorProto.INT32, [])]
    outputs = [value(n, F32, None) for n in ("y", "ok", "ov")]
    return session(node, inputs, outputs, [("", 21), ("com.microsoft", 1)])


def head_major(x: np.ndarray) -> np.ndarray:
    b, length, _ = x.shape
    return np.ascontiguousarray(x.reshape(b, length, HKV, D).transpose(0, 2, 1, 3))


def main() -> None:
    attention, gqa = attention_session(), gqa_session()
    rng = np.random.default_rng(0)
    for batch, keys in CASES:
        q, k, v = (rng.standard_normal(shape, dtype=np.float32)
                   for shape in ((batch, 1, HQ * D), (batch, keys, HKV * D), (batch, keys, HKV * D)))
        feeds_attention = dict(q=q, k=k, v=v, m=np.ones((batch, 1, 1, keys), bool))
        feeds_gqa = dict(q=q, k=k[:, -1:].copy(), v=v[:, -1:].copy(), pk=head_major(k[:, :-1]),
                         pv=head_major(v[:, :-1]), sl=np.full(batch, keys - 1, np.int32), tl=np.array(keys, np.int32))
        diff = np.abs(attention.run(None, feeds_attention)[0] - gqa.run(None, feeds_gqa)[0]).max()
        times: dict[str, list[float]] = {"Attention-23": [], "GroupQueryAttention": []}
        for _ in range(100):
            for name, sess, feeds in (("Attention-23", attention, feeds_attention),
                                      ("GroupQueryAttention", gqa, feeds_gqa)):
                start = time.perf_counter()
                sess.run(None, feeds)
                times[name].append(time.perf_counter() - start)
        medians = ", ".join(f"{name} {np.median(t) * 1e3:.3f} ms" for name, t in times.items())
        print(f"B={batch} L={keys}: {medians} (max abs diff {diff:.1e})")


if __name__ == "__main__":
    main()
