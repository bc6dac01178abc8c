"""Numerics of the TensorRT lowering, checked on the CPU.

The TensorRT targets compile the float16 graph (`write_graph(..., "float16", ...)`). No GPU is available here, so the
plan itself never runs; what can be checked is the graph it is built from:

* the float16 graph and the same lowering with only its base float type raised to float32 (exactly
  `write_graph(..., "float32", ...)`: the onnxruntime target's source graph without its attention groups in `If`
  branches) are the same graph: identical nodes,
  attributes, inputs and weights except for float dtypes and the Cast that returns float32 logits;
* ONNX Runtime's CPU provider runs the float16 graph itself, so the raised graph is not needed as a stand-in (for
  operators without a CPU float16 kernel ORT inserts Casts and computes that operator in float32). Fed exactly as the
  runtime feeds an engine (runtime/batch.py build_step; float16 caches [num_blocks, block_size, kv_heads*head_dim]),
  through packed prefill chunks and decode steps, its logits match the float32 onnxruntime engine within float16
  tolerance.

Tolerance: max |fp16 - fp32| ≤ 2e-2 × max |fp32 logits| per step. float16 keeps 11 significant bits (unit roundoff
4.9e-4): weights, activations and the KV cache are each rounded once, and the tiny models (2 layers, random weights
of std 0.08, randomised norm scales) amplify that through two attention and MLP blocks. Measured worst case per
variant (onnxruntime 1.32): 0.7e-3 to 1.6e-3 of the logits' scale, so 2e-2 leaves a >10x margin while staying far
below the differences of the order of the logits' scale a wrong lowering (a misplaced head, rope or mask) would give.
The raised graph run directly must match the engine to 1e-4 (float32 vs float32).

bfloat16 (`--dtype bfloat16`, sm80+): the same node-for-node check against the float32 lowering. ONNX Runtime has no
CPU bfloat16 kernels for most of these operators, so its numerics are checked on the graph with only the base float
type raised to float32 (bfloat16 weights widened exactly, bfloat16 inputs/outputs/Casts made float32): its logits
match the float32 engine within 5e-2 x scale (bfloat16 keeps 8 significant bits, unit roundoff 3.9e-3; this bounds
the rounding of the weights, not bfloat16 arithmetic). Measured worst case per variant: 3.5e-3 to 1.1e-2.

ONNX Runtime's CPU float16 arithmetic differs from TensorRT's GPU kernels (accumulation order and precision, fused
attention): this bounds the lowering's float16 error, not the plan's numerics on a GPU, which were never run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from camshaft.builder.build import build_engine, write_graph
from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.config import BuildConfig
from camshaft.runtime.batch import Chunk, build_step
from camshaft.runtime.engine import Engine

from tiny_models import TRT_VARIANTS, make_tiny_model

BLOCK = 4
FP16_TOLERANCE = 2e-2
BF16_TOLERANCE = 5e-2
FP32_TOLERANCE = 1e-4
FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
LOW = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


@pytest.fixture(scope="module", params=sorted(TRT_VARIANTS))
def variant(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_model(request.param, root / "hf")
    engine_dir = root / "engine"
    manifest = build_engine(BuildConfig(model_dir, engine_dir, max_seq_len=128, kv_block_size=BLOCK,
                                        max_num_tokens=64))
    graphs = {}
    for dtype in ("float16", "bfloat16", "float32"):
        out = root / dtype
        out.mkdir()
        with Checkpoint(model_dir) as checkpoint:
            graphs[dtype] = write_graph(checkpoint, manifest.limits, dtype, out)
    return request.param, engine_dir, graphs


def _load(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("low", sorted(LOW))
def test_low_precision_graph_is_the_fp32_lowering_with_its_float_types(variant, low):
    _, _, graphs = variant
    half, full = _load(graphs[low]), _load(graphs["float32"])
    # Cast nodes exist only where the float type matters (the float16 graph returns float32 logits).
    casts = [n for n in half.graph.node if n.op_type == "Cast"]
    assert [_attrs(n)["to"] for n in casts] == [TensorProto.FLOAT]
    assert not [n for n in full.graph.node if n.op_type == "Cast"]
    half_nodes = [n for n in half.graph.node if n.op_type != "Cast"]
    assert [(n.op_type, n.domain, _attrs(n)) for n in half_nodes] == [
        (n.op_type, n.domain, _attrs(n)) for n in full.graph.node]
    # Same wiring: the graphs differ only by the Cast's node name offsetting later generated names.
    assert [len(n.input) for n in half_nodes] == [len(n.input) for n in full.graph.node]

    def values(vals):
        return [(v.name, str(v.type.tensor_type.shape)) for v in vals]

    assert values(half.graph.input) == values(full.graph.input)
    assert values(half.graph.output) == values(full.graph.output)
    for a, b in zip(half.graph.input, full.graph.input, strict=True):
        ta, tb = a.type.tensor_type.elem_type, b.type.tensor_type.elem_type
        assert ta == tb or (ta, tb) == (LOW[low], TensorProto.FLOAT), a.name
    assert half.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT  # logits stay float32
    inits = {t.name: t for t in full.graph.initializer}
    for t in half.graph.initializer:
        ref = inits.get(t.name)
        if ref is None:  # a generated constant name shifted by the Cast: same constants, other numbering
            continue
        assert list(t.dims) == list(ref.dims), t.name
        assert t.data_type == ref.data_type or (t.data_type, ref.data_type) == (LOW[low], TensorProto.FLOAT), t.name
    assert sorted((list(t.dims), t.data_type in FLOATS) for t in half.graph.initializer) == sorted(
        (list(t.dims), t.data_type in FLOATS) for t in full.graph.initializer)


def raised_to_float32(path: Path, out: Path) -> Path:
    """The graph with its bfloat16 base type raised to float32: weights widened exactly, types and Casts retargeted."""
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    for i, t in enumerate(graph.initializer):
        if t.data_type == TensorProto.BFLOAT16:
            widened = numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)
            graph.initializer[i].CopyFrom(widened)
    for v in list(graph.input) + list(graph.output) + list(graph.value_info):
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            v.type.tensor_type.elem_type = TensorProto.FLOAT
    for node in graph.node:
        for a in node.attribute:
            if a.name == "to" and a.i == TensorProto.BFLOAT16:
                a.i = TensorProto.FLOAT
    assert TensorProto.BFLOAT16 not in {t.data_type for t in graph.initializer}
    onnx.save(model, str(out))
    return out


class GraphRunner:
    """Runs a raw lowered graph in ONNX Runtime with its own caches, fed as the runtime feeds an engine."""

    def __init__(self, path: Path, engine: Engine) -> None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        kv = engine.manifest.kv_cache
        self.cache_inputs = list(kv.key_inputs + kv.value_inputs)
        self.cache_outputs = list(kv.key_outputs + kv.value_outputs)
        elem = {i.name: i.type for i in self.session.get_inputs()}
        dtype = np.float16 if elem[self.cache_inputs[0]] == "tensor(float16)" else np.float32
        shape = (engine.backend.num_blocks, kv.block_size, kv.num_kv_heads * kv.head_dim)
        self.caches = {name: np.zeros(shape, dtype) for name in self.cache_inputs}
        self.engine = engine

    def step(self, chunks: list[Chunk]) -> np.ndarray:
        # as the TensorRT runtime feeds it: no group flags (its graph computes an empty group on its dummy)
        feeds = dict(build_step(chunks, self.engine.block_size, self.engine.sliding_window,
                                long_rope=self.engine.long_rope).feeds)
        feeds.update(self.caches)
        logits, *caches = self.session.run(["logits", *self.cache_outputs], feeds)
        self.caches = dict(zip(self.cache_inputs, caches, strict=True))
        return logits


def _schedule(engine: Engine, rng: np.random.Generator):
    vocab = engine.manifest.model.vocab_size
    lengths = {"a": 30, "b": 11, "c": 17}
    ids = {k: rng.integers(3, vocab, n).tolist() for k, n in lengths.items()}
    tables = {}
    for k, n in lengths.items():
        blocks = engine.pool.allocate(-(-n // BLOCK) + 1)
        rng.shuffle(blocks)
        tables[k] = blocks
    done = dict.fromkeys(ids, 0)
    steps = [{"a": 25, "b": 4}, {"a": 1, "b": 5, "c": 9}, {"a": 1, "b": 1, "c": 8}, {"a": 1, "b": 1}, {"a": 1},
             {"a": 1, "c": 1}]
    for step in steps:
        chunks = []
        for k, n in step.items():
            chunks.append(Chunk(ids[k][done[k]: done[k] + n], done[k], tables[k]))
            done[k] += n
        yield chunks


def test_fp16_graph_logits_match_fp32_engine(variant):
    name, engine_dir, graphs = variant
    engine = Engine(engine_dir, max_sequences=4)
    half = GraphRunner(graphs["float16"], engine)
    full = GraphRunner(graphs["float32"], engine)
    assert next(iter(half.caches.values())).dtype == np.float16
    worst_half = 0.0
    for chunks in _schedule(engine, np.random.default_rng(0)):
        expected = engine.step(chunks)
        scale = float(np.abs(expected).max())
        got_full = full.step(chunks)
        diff_full = float(np.abs(got_full - expected).max())
        assert diff_full <= FP32_TOLERANCE * scale, f"{name}: raised graph vs engine {diff_full:.3g}"
        got_half = half.step(chunks)
        assert got_half.dtype == np.float32 and got_half.shape == expected.shape
        diff = float(np.abs(got_half - expected).max())
        assert diff <= FP16_TOLERANCE * scale, (
            f"{name}: float16 graph vs float32 engine: max abs diff {diff:.3g} > {FP16_TOLERANCE} x scale {scale:.3g}")
        worst_half = max(worst_half, diff / scale)
    # The float16 graph really computes in float16: its logits differ from float32 by more than float32 rounding.
    assert worst_half > 1e-5, f"{name}: float16 logits identical to float32 ({worst_half:.2g})"


def transformers_bf16_deviation(model_dir: Path) -> float:
    """How far transformers' own bfloat16 run of the model strays from its float32 one (max |diff| / scale)."""
    import torch
    import transformers

    ids = torch.tensor([np.random.default_rng(0).integers(3, 384, 45).tolist()])
    with torch.no_grad():
        full, half = (transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()(ids)
                      .logits[0].float().numpy() for dtype in (torch.float32, torch.bfloat16))
    return float(np.abs(half - full).max() / np.abs(full).max())


def test_bf16_graph_raised_to_fp32_matches_fp32_engine(variant, tmp_path):
    """Within 5 % of the logits' scale, or of transformers' own bfloat16 deviation where that is larger (Gemma's
    1 + w norms and scaled embedding round more)."""
    name, engine_dir, graphs = variant
    engine = Engine(engine_dir, max_sequences=4)
    raised = GraphRunner(raised_to_float32(graphs["bfloat16"], tmp_path / "raised.onnx"), engine)
    bar = max(BF16_TOLERANCE, transformers_bf16_deviation(graphs["bfloat16"].parents[1] / "hf"))
    worst = 0.0
    for chunks in _schedule(engine, np.random.default_rng(0)):
        expected = engine.step(chunks)
        scale = float(np.abs(expected).max())
        diff = float(np.abs(raised.step(chunks) - expected).max())
        assert diff <= bar * scale, (
            f"{name}: raised bfloat16 graph vs float32 engine: {diff:.3g} > {bar:.3g} x {scale:.3g}")
        worst = max(worst, diff / scale)
    print(f"{name}: bfloat16 weights, worst |diff| / scale {worst:.2g}")
    assert worst > 1e-4, f"{name}: bfloat16 weights give float32 logits ({worst:.2g}): nothing was rounded"
