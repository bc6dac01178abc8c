"""--lm-head int8|int4: the output projection rounded to nearest at build time, on a tiny tied-embedding model.

Reference: the fake-quantized model's final normed hidden states (ModelOpt, just before export) times a numpy
round-to-nearest copy of the head; with MatMulNBits accuracy level 4 the activations are also rounded to int8 per
block of K, as ONNX Runtime does. int4 keeps the head's largest input channels (recorded by `camshaft quantize`)
float: they are zeroed in the rounded matrix and in the rounded product's input, and multiplied in float. The
onnxruntime engine's embedding lookup reads the same matrix (tied), so its reference's hidden states come from the
fake-quant model with that embedding. Bar: |engine − reference| ≤ 10 % of what quantizing the head changes.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from camshaft import cli
from camshaft.builder.build import build_engine, write_graph
from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.config import BuildConfig
from camshaft.errors import BuildConfigError
from camshaft.model_config import CAMSHAFT_QUANT_RECORD, ModelConfig
from camshaft.quantize.calibration import load_texts, tokenize
from camshaft.quantize.modelopt_adapter import quantize_checkpoint
from camshaft.quantize.spec import LM_HEAD_BLOCKS, LM_HEAD_FLOAT_CHANNELS, QuantizeError, QuantSpec, check_lm_head_fits
from camshaft.runtime.batch import Chunk, build_step
from camshaft.runtime.engine import Engine
from camshaft.runtime.sequence import SequenceEngine

from tiny_models import make_tiny_model

pytest.importorskip("modelopt.torch.quantization")

PROMPT_LEN = 24
BITS = {"int4": 4, "int8": 8}


def rtn(weight: np.ndarray, bits: int, block: int, full_range: bool) -> np.ndarray:
    """Round to nearest; full range: the block's largest-magnitude value maps to -2^(bits-1) (the scale carries its
    sign, ONNX Runtime's form), else scale = amax / (2^(bits-1) - 1) (positive, for TensorRT)."""
    w = weight.reshape(weight.shape[0], -1, block)
    if full_range:
        scale = np.take_along_axis(w, np.abs(w).argmax(-1)[..., None], -1) / -(2 ** (bits - 1))
    else:
        scale = np.abs(w).max(-1, keepdims=True) / (2 ** (bits - 1) - 1)
    return (np.clip(np.round(w / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * scale).reshape(weight.shape)


def head_weight(embed: np.ndarray, bits: int, block: int, full_range: bool, channels: list[int]) -> np.ndarray:
    """The head as the engine applies it: the float channels' columns exact, the rest rounded without them."""
    zeroed = embed.copy()
    zeroed[:, channels] = 0
    weight = rtn(zeroed, bits, block, full_range)
    weight[:, channels] = embed[:, channels]
    return weight


def int8_blocks(x: np.ndarray, block: int) -> np.ndarray:
    xb = x.reshape(x.shape[0], -1, block)
    scale = np.abs(xb).max(-1, keepdims=True) / 127
    return (np.round(xb / scale) * scale).reshape(x.shape)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """{head: checkpoint dir, engine dir}, plus the fake-quant model's normed hidden states, logits and embedding."""
    root = tmp_path_factory.mktemp("head")
    tiny = make_tiny_model("llama3-rope", root / "hf")  # tied embeddings
    prompt = torch.randint(3, 384, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    ref: dict = {"prompt": prompt[0].tolist()}
    kept: dict = {}

    def capture(model):
        kept["model"] = copy.deepcopy(model)  # the export packs this one; the float channels are known after it
        with torch.no_grad():
            ref["logits"] = model(prompt).logits[0].numpy().copy()
            ref["normed"] = model.model(prompt).last_hidden_state[0].numpy().copy()
        ref["embed"] = model.model.embed_tokens.weight.detach().numpy().copy()

    quantize_checkpoint(tiny, root / "int4", QuantSpec("int4_wo", lm_head="int4"), on_quantized=capture,
                        calib_size=2, calib_seq_len=32)
    ref["channels"] = json.loads((root / "int4" / CAMSHAFT_QUANT_RECORD).read_text())["lm_head_float_channels"]
    ref["largest"] = largest_head_inputs(tiny, calib_size=2, calib_seq_len=32)
    model = kept["model"]
    with torch.no_grad():  # the engine's lookup: the rounded head (int4 blocks with float channels, int8 per row)
        for head, bits in BITS.items():
            block = LM_HEAD_BLOCKS[head] or ref["embed"].shape[1]
            channels = ref["channels"] if LM_HEAD_FLOAT_CHANNELS[head] else []
            model.model.embed_tokens.weight.copy_(torch.from_numpy(head_weight(ref["embed"], bits, block, True,
                                                                               channels)))
            ref[f"normed-{head}"] = model.model(prompt).last_hidden_state[0].numpy().copy()
    shutil.copytree(root / "int4", root / "int8")  # the record is all that --lm-head changes in a checkpoint
    record = json.loads((root / "int8" / CAMSHAFT_QUANT_RECORD).read_text())
    (root / "int8" / CAMSHAFT_QUANT_RECORD).write_text(json.dumps({**record, "lm_head": "int8"}))
    dirs = {}
    for head in BITS:
        build_engine(BuildConfig(root / head, root / f"{head}-engine", max_seq_len=64, kv_block_size=4,
                                 max_num_tokens=32, weight_only_compute="float"))  # the body exact: the head is checked
        dirs[head] = (root / head, root / f"{head}-engine")
    return dirs, ref


def largest_head_inputs(model_dir, calib_size: int, calib_seq_len: int) -> list[int]:
    """The float model's final normed hidden states over the default calibration tokens: channels by mean |x|."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    calib = tokenize(*load_texts(None), tokenizer, calib_size, calib_seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        normed = np.concatenate([model.model(torch.from_numpy(row[None])).last_hidden_state[0].numpy()
                                 for row in calib.input_ids])
    return np.argsort(-np.abs(normed).mean(0), kind="stable")[:LM_HEAD_FLOAT_CHANNELS["int4"]].tolist()


def reference(ref: dict, bits: int, block: int, act_block: int | None, full_range: bool,
              normed: str = "normed") -> np.ndarray:
    channels = ref["channels"] if LM_HEAD_FLOAT_CHANNELS[{4: "int4", 8: "int8"}[bits]] else []
    x = ref[normed]
    rounded = x.copy()
    rounded[:, channels] = 0  # as the engine zeroes them before the rounded product (and its int8 activations)
    if act_block is not None:
        rounded = int8_blocks(rounded, act_block)
    weight = head_weight(ref["embed"], bits, block, full_range, channels)
    exact = np.zeros_like(weight)
    exact[:, channels] = weight[:, channels]
    return rounded @ (weight - exact).T + x @ exact.T


def check(logits: np.ndarray, expected: np.ndarray, ref: dict, what: str) -> None:
    diff, change = np.abs(logits - expected).max(), np.abs(expected - ref["logits"]).max()
    print(f"{what}: |engine - reference| {diff:.3g}, quantized head changes {change:.3g}")
    assert change > 1e-3 and diff <= 0.1 * change


@pytest.mark.parametrize("head", sorted(BITS))
def test_quantized_head_matches_round_to_nearest_reference(heads, head):
    dirs, ref = heads
    ckpt, engine_dir = dirs[head]
    assert json.loads((ckpt / CAMSHAFT_QUANT_RECORD).read_text())["lm_head"] == head
    engine = Engine(engine_dir, max_sequences=1)
    record = engine.manifest.quantization
    assert record["lm_head"]["dtype"] == head and record["quantized_linear_layers"] == 14
    assert record["float_modules"] == []
    assert record["lm_head"]["embedding"] == "the head's tensors (GatherBlockQuantized)"
    if head == "int4":  # the largest input channels over the calibration tokens stay float
        assert record["lm_head"]["float_channels"] == ref["channels"] == ref["largest"]
    else:
        assert record["lm_head"]["float_channels"] == []
    graph = onnx.load(engine_dir / "model.onnx", load_external_data=False).graph
    vocab, hidden = ref["embed"].shape
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    attrs = {n.name: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nbits}
    head_node = next(n for n in nbits if attrs[n.name]["N"] == vocab)
    a = attrs[head_node.name]
    assert a["K"] == hidden and a["bits"] == BITS[head]
    # the lookup reads the head's integer tensor; no float table is stored
    lookup = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    assert lookup.input[0] == head_node.input[1]
    assert not [t.name for t in graph.initializer if tuple(t.dims) in ((vocab, hidden), (hidden, vocab))]
    block = record["lm_head"]["block_size"] or hidden
    expected = reference(ref, BITS[head], block, a["block_size"] if a["accuracy_level"] == 4 else None, True,
                         normed=f"normed-{head}")
    logits = engine.step([Chunk(ref["prompt"], 0, engine.pool.allocate(PROMPT_LEN // 4), PROMPT_LEN)])
    check(logits, expected, ref, f"lm_head {head}, accuracy level {a['accuracy_level']}")
    sequence = SequenceEngine(engine_dir)  # the Session's graph: the same lookup and head
    sequence.start(PROMPT_LEN)
    last = sequence.feed(ref["prompt"], 0)
    sequence.close()
    check(last[None], expected[-1:], {**ref, "logits": ref["logits"][-1:]}, f"sequence graph, lm_head {head}")


@pytest.mark.parametrize("head", sorted(BITS))
def test_quantized_head_qdq_graph_for_tensorrt(heads, head, tmp_path):
    """The TensorRT targets' form (weight DequantizeLinear → MatMul, float activations), raised to float32 and run by
    ONNX Runtime as written, matches the round-to-nearest head."""
    dirs, ref = heads
    ckpt, engine_dir = dirs[head]
    engine = Engine(engine_dir, max_sequences=1)
    with Checkpoint(ckpt) as c:
        graph = write_graph(c, engine.manifest.limits, "float32", tmp_path, qdq=True)
    model = onnx.load(graph, load_external_data=False).graph
    assert not any(n.domain for n in model.node)
    vocab, hidden = ref["embed"].shape
    elem = {"int4": onnx.TensorProto.INT4, "int8": onnx.TensorProto.INT8}[head]
    assert any(t.data_type == elem and tuple(t.dims) == (hidden, vocab) for t in model.initializer)
    kv = engine.manifest.kv_cache
    chunk = Chunk(ref["prompt"], 0, engine.pool.allocate(PROMPT_LEN // 4), PROMPT_LEN)
    feeds = dict(build_step([chunk], engine.block_size, engine.sliding_window).feeds)  # no group flags: TensorRT's
    shape = (engine.backend.num_blocks, kv.block_size, kv.num_kv_heads * kv.head_dim)
    feeds.update({name: np.zeros(shape, np.float32) for name in kv.key_inputs + kv.value_inputs})
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    logits = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    block = engine.manifest.quantization["lm_head"]["block_size"] or hidden
    check(logits, reference(ref, BITS[head], block, None, False), ref, f"lm_head {head} Q/DQ")


def test_bad_lm_head_is_refused_before_any_work(heads, capsys, tmp_path):
    with pytest.raises(QuantizeError, match="unknown --lm-head 'int2'; choose one of: float, int8, int4"):
        QuantSpec("int4_awq", lm_head="int2")
    dirs, _ = heads
    model = ModelConfig.from_hf_dir(dirs["int4"][0])
    check_lm_head_fits(QuantSpec("int8_wo", lm_head="int8"), replace(model, hidden_size=80))  # blocks of 16
    with pytest.raises(QuantizeError, match="blocks of 64 inputs, which do not divide hidden_size 80; use --lm-head "
                                            "int8 or float"):
        check_lm_head_fits(QuantSpec("int8_wo", lm_head="int4"), replace(model, hidden_size=80))
    with pytest.raises(QuantizeError, match="hidden_size 72; use --lm-head float$"):  # not int8: it fits neither
        check_lm_head_fits(QuantSpec("int8_wo", lm_head="int4"), replace(model, hidden_size=72))
    with pytest.raises(QuantizeError, match="--lm-head int8 runs in blocks of 16 to 128 inputs .* none of which "
                                            "divides hidden_size 72; use --lm-head float"):  # the build crashed
        check_lm_head_fits(QuantSpec("int8_wo", lm_head="int8"), replace(model, hidden_size=72))
    argv = sys.argv
    sys.argv = ["camshaft", "build", "--model", str(dirs["int4"][0]), "--output", str(tmp_path / "e"),
                "--lm-head", "int4"]
    try:
        with pytest.raises(SystemExit):
            cli.main()
    finally:
        sys.argv = argv
    err = " ".join(capsys.readouterr().err.split())
    assert "--lm-head is a quantization option, and" in err and "is already quantized: quantize the original float " \
        "checkpoint again with it" in err and not (tmp_path / "e").exists()


def test_int4_head_on_a_w8a8_checkpoint_keeps_float_compute(tmp_path):
    """The int8-compute default is for weight-only checkpoints: an int4 lm_head over fp8 / int8_sq layers multiplies
    in float (accuracy level 0), as before the option existed."""
    tiny = make_tiny_model("llama", tmp_path / "hf")
    quantize_checkpoint(tiny, tmp_path / "fp8", QuantSpec("fp8", lm_head="int4"), calib_size=2, calib_seq_len=32)
    manifest = build_engine(BuildConfig(tmp_path / "fp8", tmp_path / "e", max_seq_len=64, kv_block_size=4))
    head = manifest.quantization["lm_head"]
    assert head["dtype"] == "int4" and head["accuracy_level"] == 0 and head["activations"] is None


def test_int4_head_without_recorded_float_channels_is_refused(heads, tmp_path):
    """A checkpoint quantized before the int4 head kept float channels (no lm_head_float_channels in its record)
    is refused with what to do, not built with a less accurate head."""
    dirs, _ = heads
    old = tmp_path / "old"
    shutil.copytree(dirs["int4"][0], old)
    record = json.loads((old / CAMSHAFT_QUANT_RECORD).read_text())
    del record["lm_head_float_channels"]
    (old / CAMSHAFT_QUANT_RECORD).write_text(json.dumps(record))
    with pytest.raises(BuildConfigError, match=r"records none \(lm_head_float_channels .*Quantize the original"):
        build_engine(BuildConfig(old, tmp_path / "e", max_seq_len=64, kv_block_size=4))
    assert not (tmp_path / "e").exists()
