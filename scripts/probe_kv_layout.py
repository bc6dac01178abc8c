"""Two paged KV cache layouts for batched decode, 30 layers of block-table Gather + ONNX Attention, same run.

current:     cache [blocks, block, kv_heads*dim], Gather on axis 0 -> [B, L, kv*dim], 3-D Attention (the engine's)
head-major:  cache [kv_heads, blocks, block, dim], Gather on axis 1 -> [kv*B, 1, L, dim], 4-D Attention with
             kv_heads x B as its batch (no transpose of K/V)
SmolLM2's heads (9 query, 3 K/V, dim 64), blocks of 32, query heads grouped per K/V head as the engine does.
Medians of interleaved runs, 2 threads. Usage: python scripts/probe_kv_layout.py [BATCH CONTEXT ...]
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # as camshaft does, before onnxruntime is imported

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

BLOCK, KV, PER_KV, D, LAYERS = 32, 3, 3, 64, 30


def graph(layout: str, batch: int, context: int) -> onnx.ModelProto:
    nb = context // BLOCK
    blocks = batch * nb + 1
    nodes, inits = [], []

    def const(name: str, values: list[int]) -> None:
        inits.append(onnx.numpy_helper.from_array(np.array(values, dtype=np.int64), name))

    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [batch, KV * PER_KV * D]),
              helper.make_tensor_value_info("tables", TensorProto.INT64, [batch, nb]),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, [batch, 1, 1, context])]
    head_major = layout == "head-major"
    const("q4", [batch, KV, PER_KV, D])
    const("flat", [batch, KV * PER_KV * D])
    if head_major:
        const("qg", [KV * batch, 1, PER_KV, D]), const("kvs", [KV * batch, 1, context, D])
        const("out4", [KV, batch, PER_KV, D]), const("m5", [KV, batch, 1, PER_KV, context])
        const("m4", [KV * batch, 1, PER_KV, context])
        nodes += [helper.make_node("Reshape", ["q", "q4"], ["qr"]),
                  helper.make_node("Transpose", ["qr"], ["qt"], perm=[1, 0, 2, 3]),
                  helper.make_node("Reshape", ["qt", "qg"], ["query"]),
                  helper.make_node("Expand", ["mask", "m5"], ["me"]),
                  helper.make_node("Reshape", ["me", "m4"], ["m"])]
    else:
        const("qg", [batch, PER_KV, KV * D]), const("kvs", [batch, context, KV * D])
        const("out4", [batch, PER_KV, KV, D]), const("m4", [batch, 1, PER_KV, context])
        nodes += [helper.make_node("Reshape", ["q", "q4"], ["qr"]),
                  helper.make_node("Transpose", ["qr"], ["qt"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", ["qt", "qg"], ["query"]),
                  helper.make_node("Expand", ["mask", "m4"], ["m"])]
    outs = []
    for i in range(LAYERS):
        shape = [KV, blocks, BLOCK, D] if head_major else [blocks, BLOCK, KV * D]
        for t in "kv":
            inputs.append(helper.make_tensor_value_info(f"{t}{i}", TensorProto.FLOAT, shape))
            nodes += [helper.make_node("Gather", [f"{t}{i}", "tables"], [f"{t}g{i}"], axis=1 if head_major else 0),
                      helper.make_node("Reshape", [f"{t}g{i}", "kvs"], [f"{t}r{i}"])]
        heads = {} if head_major else {"q_num_heads": KV, "kv_num_heads": KV}
        nodes += [helper.make_node("Attention", ["query", f"kr{i}", f"vr{i}", "m"], [f"a{i}"], scale=D ** -0.5,
                                   **heads),
                  helper.make_node("Reshape", [f"a{i}", "out4"], [f"ar{i}"]),
                  helper.make_node("Transpose", [f"ar{i}"], [f"at{i}"], perm=[1, 0, 2, 3] if head_major else
                                   [0, 2, 1, 3]),
                  helper.make_node("Reshape", [f"at{i}", "flat"], [f"o{i}"])]
        outs.append(f"o{i}")
    nodes.append(helper.make_node("Sum", outs, ["out"]))
    output = helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, KV * PER_KV * D])
    return helper.make_model(helper.make_graph(nodes, "probe", inputs, [output], inits),
                             opset_imports=[helper.make_opsetid("", 23)])


def compare(batch: int, context: int, rounds: int = 15) -> dict[str, float]:
    rng = np.random.default_rng(0)
    nb = context // BLOCK
    blocks = batch * nb + 1
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    tables = rng.permutation(np.arange(1, blocks))[: batch * nb].reshape(batch, nb).astype(np.int64)
    lengths = rng.integers(context // 2, context + 1, batch)
    common = {"q": rng.standard_normal((batch, KV * PER_KV * D), dtype=np.float32), "tables": tables,
              "mask": (np.arange(context)[None, :] < lengths[:, None]).reshape(batch, 1, 1, context)}
    caches = [rng.standard_normal((blocks, BLOCK, KV * D), dtype=np.float32) for _ in range(2 * LAYERS)]
    feeds, sessions = {}, {}
    for layout in ("current", "head-major"):
        if layout == "head-major":
            caches = [np.ascontiguousarray(c.reshape(blocks, BLOCK, KV, D).transpose(2, 0, 1, 3)) for c in caches]
        feeds[layout] = {**common, **{f"{t}{i}": caches[2 * i + (t == "v")] for i in range(LAYERS) for t in "kv"}}
        sessions[layout] = ort.InferenceSession(graph(layout, batch, context).SerializeToString(), options,
                                                providers=["CPUExecutionProvider"])
    first = [sessions[k].run(None, feeds[k])[0] for k in sessions]
    assert np.allclose(first[0], first[1], atol=1e-4), "the two layouts disagree"
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for r in range(rounds):
        for k in (list(sessions) if r % 2 else list(sessions)[::-1]):
            start = time.perf_counter()
            sessions[k].run(None, feeds[k])
            times[k].append(time.perf_counter() - start)
    return {k: float(np.median(v)) * 1000 for k, v in times.items()}


def main(argv: list[str]) -> None:
    cases = [(int(b), int(c)) for b, c in zip(argv[::2], argv[1::2], strict=True)] or [(32, 320), (32, 448)]
    print("| batch | context | current ms | head-major ms | head-major / current |")
    print("|---|---|---|---|---|")
    for batch, context in cases:
        ms = compare(batch, context)
        print(f"| {batch} | {context} | {ms['current']:.1f} | {ms['head-major']:.1f} | "
              f"{ms['head-major'] / ms['current']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
