"""Quantization: ModelOpt calibration → unified HF checkpoint → MatMulNBits engine, on tiny models.

References: ModelOpt's own fake-quantized model (weights and logits through transformers), captured just before
export. The engine must reproduce it: checkpoint weights dequantize to the fake-quantized weights, and the engine's
logits differ from the fake-quant model's by at most 10% of how far the fake-quant model is from float32.
Weight-only formats are checked built with `weight_only_compute="float"` (exact dequantized weights) and with the
default int8 compute (MatMulNBits accuracy level 4), whose reference is the fake-quant model with every quantized
layer's input rounded to int8 per block of K, as ONNX Runtime does.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from camshaft.builder.build import build_engine, write_graph
from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.config import BuildConfig
from camshaft.builder.graph.linear import LOWERINGS, NBITS_BLOCK_SIZES
from camshaft.errors import BuildConfigError
from camshaft.model_config import CAMSHAFT_QUANT_RECORD
from camshaft.quantize.modelopt_adapter import quantize_checkpoint
from camshaft.quantize.spec import FORMATS, SMOOTHQUANT_ALPHA, SMOOTHQUANT_PER_TOKEN_ALPHA, QuantSpec, modelopt_config
from camshaft.runtime.batch import Chunk, build_step
from camshaft.runtime.engine import Engine
from camshaft.runtime.sequence import SequenceEngine

from tiny_models import make_tiny_model

pytest.importorskip("modelopt.torch.quantization")

VARIANT = "llama"  # hidden 64, heads*dim 64, intermediate 96: every input dim divides by 32 (auto → 32)
PROMPT_LEN = 40
CALIB = dict(calib_size=4, calib_seq_len=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return make_tiny_model(VARIANT, root / "hf")


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 384, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))


LOWERING = {"int4_wo": "com.microsoft.MatMulNBits", "int8_wo": "com.microsoft.MatMulNBits",
            "int4_awq": "com.microsoft.MatMulNBits", "fp8": "QuantizeLinear/DequantizeLinear float8e4m3fn + MatMul",
            "fp8_pc_pt": "input rounded to float8e4m3fn per token (ReduceMax, Cast) + weight DequantizeLinear + MatMul",
            "int8_sq": "QuantizeLinear uint8 + MatMulInteger + Mul by input x weight scales",
            "int8_sq_pt": "input rounded to int8 per token (ReduceMax, Round) + MatMulInteger + Mul by token x weight "
                          "scales",
            "w4a8_awq": "float8 input Q/DQ; int4 blocked DequantizeLinear, float8 Q/DQ of the weight; MatMul"}
MAX_BOUND = {"fp8": 448.0, "int8_sq": 127.0, "w4a8_awq": 448.0}  # ModelOpt's input_scale = amax / max bound
WEIGHT_ONLY = ("int4_wo", "int8_wo", "int4_awq")


def int8_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """What MatMulNBits accuracy level 4 does to its input: symmetric int8 per block of K, round to nearest."""
    xb = x.reshape(*x.shape[:-1], -1, block)
    scale = xb.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(xb / scale) * scale).reshape(x.shape)


def activation_block(fmt: str, in_dim: int) -> int:
    """MatMulNBits' block: the group size for INT4; for INT8 per-channel, the largest block size dividing K."""
    return 32 if fmt != "int8_wo" else next(b for b in NBITS_BLOCK_SIZES if in_dim % b == 0)


def int8_activation_logits(model, fmt: str, prompt: torch.Tensor) -> np.ndarray:
    """The fake-quant model with each quantized layer's input (after AWQ's pre_quant_scale) rounded to int8 blocks."""
    hooks = []
    for module in model.modules():
        wq = getattr(module, "weight_quantizer", None)
        if wq is not None and wq.is_enabled:
            block = activation_block(fmt, module.in_features)
            hooks.append(module.input_quantizer.register_forward_hook(
                lambda _m, _i, out, block=block: int8_blocks(out, block)))
    try:
        with torch.no_grad():
            return model(prompt).logits[0].numpy().copy()
    finally:
        for hook in hooks:
            hook.remove()


def assert_matches_fake_quant(fmt: str, logits: np.ndarray, expected: np.ndarray, fp32: np.ndarray) -> None:
    """Logits within 10 % of the fake-quant model's distance from fp32 (max over all logits). Per-token int8 rounds
    each input row to 255 levels, so the tiny float differences between two correct implementations (fused norms,
    attention kernels) flip a rounding now and then: one flip moves a token's row by a fifth of that distance on
    these tiny models. There, most rows must meet the bar and any row may be off by at most half the distance."""
    bar = 0.1 * np.abs(expected - fp32).max()
    rows = np.abs(logits - expected).reshape(-1, logits.shape[-1]).max(axis=-1)
    if fmt != "int8_sq_pt":
        assert rows.max() <= bar, (fmt, rows.max(), bar)
        return
    print(f"{fmt}: rows over the bar (rounding flips): {int((rows > bar).sum())} of {len(rows)}")
    assert np.median(rows) <= bar and rows.max() <= 5 * bar and (rows > bar).mean() <= 0.25, (fmt, rows, bar)


@pytest.fixture(scope="module", params=["int4_wo", "int8_wo", "int4_awq", "fp8", "fp8_pc_pt", "int8_sq", "int8_sq_pt",
                                                      "w4a8_awq"])
def quantized(request, tiny, prompt, tmp_path_factory):
    """(format, checkpoint dir, engine dir, fake-quant weights/pre-quant scales/logits, fp32 logits)."""
    fmt = request.param
    root = tmp_path_factory.mktemp(fmt)
    ref: dict = {}

    def capture(model):
        with torch.no_grad():
            ref["logits"] = model(prompt).logits[0].numpy().copy()
            ref["weights"], ref["pqs"], ref["input_amax"] = {}, {}, {}
            for name, module in model.named_modules():
                wq = getattr(module, "weight_quantizer", None)
                if wq is not None and wq.is_enabled:
                    ref["weights"][name] = wq(module.weight).numpy().copy()
                iq = getattr(module, "input_quantizer", None)
                if iq is not None and iq.is_enabled and iq.amax is not None:  # (dynamic: none)
                    ref["input_amax"][name] = float(iq.amax)
                pqs = getattr(getattr(module, "input_quantizer", None), "pre_quant_scale", None)
                if pqs is not None:
                    ref["pqs"][name] = pqs.numpy().copy()
        if fmt in WEIGHT_ONLY:
            ref["int8_activation_logits"] = int8_activation_logits(model, fmt, prompt)

    result = quantize_checkpoint(tiny, root / "ckpt", QuantSpec(fmt), on_quantized=capture, **CALIB)
    limits = dict(max_seq_len=128, kv_block_size=4, max_num_tokens=64)
    compute = "float" if fmt in WEIGHT_ONLY else "auto"
    build_engine(BuildConfig(root / "ckpt", root / "engine", weight_only_compute=compute, **limits))
    if fmt in WEIGHT_ONLY:
        build_engine(BuildConfig(root / "ckpt", root / "engine-int8-compute", **limits))
    else:
        with pytest.raises(BuildConfigError, match="weight-only checkpoints"):
            build_engine(BuildConfig(root / "ckpt", root / "refused", weight_only_compute="int8", **limits))
        assert not (root / "refused").exists()
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    with torch.no_grad():
        ref["fp32"] = fp32(prompt).logits[0].numpy()
    return fmt, result, root / "engine", ref


def test_checkpoint_weights_dequantize_to_modelopt_fake_quant_weights(quantized):
    fmt, result, _, ref = quantized
    assert len(ref["weights"]) == 2 * 7  # q k v o gate up down, 2 layers; lm_head stays float
    with Checkpoint(result.output) as ckpt:
        assert ckpt.quantization["camshaft"]["format"] == fmt
        for name, expected in ref["weights"].items():
            layer = ckpt.quantized_linear(name, *expected.shape)
            assert layer is not None, name
            assert layer.bits == FORMATS[fmt].weight_bits
            assert layer.block_size == (32 if FORMATS[fmt].blockwise else expected.shape[1])
            atol = 1e-6 * np.abs(expected).max()
            np.testing.assert_allclose(layer.weight(), expected, rtol=0, atol=atol, err_msg=name)
            if name in ref["pqs"]:  # AWQ/SmoothQuant scales kept beside the layer (AWQ folds the others into norms)
                np.testing.assert_array_equal(layer.pre_quant_scale, ref["pqs"][name])
            else:
                assert layer.pre_quant_scale is None
            if fmt in MAX_BOUND:  # W8A8 / FP8: the static input scale the engine quantizes activations with
                assert layer.input_scale == pytest.approx(ref["input_amax"][name] / MAX_BOUND[fmt], rel=1e-6)
            else:
                assert layer.input_scale is None and not ref["input_amax"]
        assert ckpt.quantized_linear("lm_head", 384, 64) is None
    if "awq" in fmt:
        assert {n.rsplit(".", 1)[-1] for n in ref["pqs"]} == {"o_proj", "down_proj"}
    if fmt.startswith("int8_sq"):  # SmoothQuant's per-channel scales stay beside every layer in ModelOpt's export
        assert len(ref["pqs"]) == 14


def test_engine_logits_match_modelopt_fake_quant_model(quantized, prompt):
    fmt, result, engine_dir, ref = quantized
    engine = Engine(engine_dir, max_sequences=1)
    manifest = engine.manifest.quantization
    record = json.loads((result.output / CAMSHAFT_QUANT_RECORD).read_text())
    assert manifest["algorithm"] == record["algorithm"] == modelopt_config(QuantSpec(fmt), None)["algorithm"]
    import platform  # the built-in corpus is this Python's docstrings: the record says which, and the samples' hash
    assert record["tools"]["python"] == platform.python_version()
    assert len(record["calibration"]["tokens_sha256"]) == 64 and manifest["calibration"] == record["calibration"]
    if fmt.startswith("int8_sq"):
        alpha = SMOOTHQUANT_ALPHA if fmt == "int8_sq" else SMOOTHQUANT_PER_TOKEN_ALPHA
        assert record["algorithm"] == {"method": "smoothquant", "alpha": alpha}
    assert manifest["format"] == fmt and manifest["lowering"] == LOWERING[fmt]
    activations = {"fp8": "fp8 static per-tensor", "w4a8_awq": "fp8 static per-tensor",
                   "int8_sq": "int8 static per-tensor", "fp8_pc_pt": "fp8 dynamic per-token",
                   "int8_sq_pt": "int8 dynamic per-token"}.get(fmt)
    assert manifest["activations"] == activations
    assert manifest["quantized_linear_layers"] == 14
    assert manifest["float_modules"] == ["lm_head", "model.embed_tokens"] and manifest["lm_head"] == {"dtype": "float"}
    logits = engine.step([Chunk(prompt[0].tolist(), 0, engine.pool.allocate(PROMPT_LEN // 4), PROMPT_LEN)])
    engine_vs_fq = np.abs(logits - ref["logits"]).max()
    fq_vs_fp32 = np.abs(ref["logits"] - ref["fp32"]).max()
    print(f"{fmt}: |engine - fake-quant| {engine_vs_fq:.3g}, |fake-quant - fp32| {fq_vs_fp32:.3g}")
    assert fq_vs_fp32 > 1e-3  # the quantization is real
    assert_matches_fake_quant(fmt, logits, ref["logits"], ref["fp32"])


def test_sequence_graph_logits_match_modelopt_fake_quant_model(quantized, prompt):
    """The Session's sequence graph lowers the same quantized layers: a prefill, then one token at a time."""
    fmt, _, engine_dir, ref = quantized
    engine = SequenceEngine(engine_dir)
    ids = prompt[0].tolist()
    engine.start(PROMPT_LEN)
    rows = [engine.feed(ids[:30], 0)] + [engine.feed([t], 30 + i) for i, t in enumerate(ids[30:])]
    logits, expected, fp32 = np.stack(rows), ref["logits"][29:], ref["fp32"][29:]
    assert np.abs(expected - fp32).max() > 1e-3
    assert_matches_fake_quant(fmt, logits, expected, fp32)
    engine.close()
    # its weights are the batch graph's (MatMulNBits gate/up joined by Concats; other formats: two products)
    graph = onnx.load(engine_dir / "sequence.onnx", load_external_data=False).graph
    own = [(t.name, {e.key: e.value for e in t.external_data}) for t in graph.initializer if t.external_data]
    own = [int(e["length"]) for name, e in own if e["location"] == "sequence.onnx.data"
           and not name.startswith("lm_head.screen_")]  # the float head's int8 screen (screen.py) is its own
    assert all(n < 1024 for n in own), own  # copies only of what the batch artifact keeps inline (under 1 KB)


def test_weight_only_int8_compute_matches_int8_activation_reference(quantized, prompt):
    """The default build of a weight-only checkpoint computes with int8 activations, and its logits follow that math:
    within 10 % of what rounding the activations changes (and not the float-compute engine's logits)."""
    fmt, _, engine_dir, ref = quantized
    if fmt not in WEIGHT_ONLY:
        pytest.skip("W8A8 / FP8 formats quantize their activations themselves (checked above)")
    engine = Engine(engine_dir.with_name("engine-int8-compute"), max_sequences=1)
    record = engine.manifest.quantization
    assert record["accuracy_level"] == 4
    assert record["activations"] == "int8 dynamic per block (MatMulNBits accuracy level 4)"
    logits = engine.step([Chunk(prompt[0].tolist(), 0, engine.pool.allocate(PROMPT_LEN // 4), PROMPT_LEN)])
    expected = ref["int8_activation_logits"]
    diff, change = np.abs(logits - expected).max(), np.abs(expected - ref["logits"]).max()
    print(f"{fmt} int8 compute: |engine - int8-activation reference| {diff:.3g}, rounding activations changes "
          f"{change:.3g}")
    assert change > 1e-4 and diff <= 0.1 * change
    float_engine = Engine(engine_dir, max_sequences=1)
    assert float_engine.manifest.quantization["accuracy_level"] == 0
    float_logits = float_engine.step([Chunk(prompt[0].tolist(), 0, float_engine.pool.allocate(PROMPT_LEN // 4),
                                            PROMPT_LEN)])
    assert np.abs(float_logits - expected).max() > 2 * diff


def test_engine_stores_quantized_weights_and_runs_integer_kernels(quantized):
    """The artifact keeps 1-byte weights (no constant folding back to float); W8A8 runs ONNX Runtime's integer
    matmul; FP8 keeps its Q/DQ nodes (ONNX Runtime has no float8 matmul on the CPU)."""
    fmt, _, engine_dir, _ = quantized
    if fmt not in MAX_BOUND and fmt not in ("fp8_pc_pt", "int8_sq_pt"):
        pytest.skip("weight-only formats are MatMulNBits (checked by the manifest)")
    graph = onnx.load(engine_dir / "model.onnx", load_external_data=False)
    ops = Counter(n.op_type for n in graph.graph.node)
    elem = Counter(t.data_type for t in graph.graph.initializer if np.prod(t.dims) >= 64 * 32)
    # per layer: fused q/k/v, o, gate, up, down; gate and up quantize the same input (ONNX Runtime merges their fp8
    # QuantizeLinear nodes, not the DequantizeLinear ones)
    if fmt == "fp8":
        assert ops["QuantizeLinear"] == 8 and ops["DequantizeLinear"] == 20
        assert elem[onnx.TensorProto.FLOAT8E4M3FN] == 10
    elif fmt == "fp8_pc_pt":  # each distinct input rounded per token by a Cast to float8 (gate and up: merged)
        assert ops["QuantizeLinear"] == 0 and ops["DequantizeLinear"] == 10 and ops["ReduceMax"] == 8
        casts = Counter(a.i for n in graph.graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to")
        assert casts[onnx.TensorProto.FLOAT8E4M3FN] == 8
        assert elem[onnx.TensorProto.FLOAT8E4M3FN] == 10
    elif fmt == "w4a8_awq":  # the int4 weight's DequantizeLinear, its float8 Q/DQ, the input's Q/DQ
        assert ops["QuantizeLinear"] == 18 and ops["DequantizeLinear"] == 30
        assert elem[onnx.TensorProto.INT4] == 10
    else:
        assert ops["MatMulInteger"] + ops["MatMulIntegerToFloat"] == 10 and ops["DequantizeLinear"] == 0
        assert elem[onnx.TensorProto.INT8] == 10
        per_token = fmt == "int8_sq_pt"  # each product's input rounded per token
        assert ops["ReduceMax"] == (10 if per_token else 0) and ops["QuantizeLinear"] == (0 if per_token else 10)


def test_qdq_graph_for_tensorrt_matches_fake_quant_model(quantized, prompt, tmp_path):
    """The graph the TensorRT targets get (every format as standard Q/DQ), raised to float32 and run by ONNX Runtime
    on the CPU, meets the same bar: the lowering the plans are built from is ModelOpt's fake-quant model."""
    fmt, result, engine_dir, ref = quantized
    engine = Engine(engine_dir, max_sequences=1)
    with Checkpoint(result.output) as ckpt:
        graph = write_graph(ckpt, engine.manifest.limits, "float32", tmp_path, qdq=True)
    ops = Counter(n.op_type for n in onnx.load(graph, load_external_data=False).graph.node)
    assert ops["DequantizeLinear"] >= 8 and not ops["MatMulNBits"] and not ops["MatMulInteger"]
    kv = engine.manifest.kv_cache
    shape = (engine.backend.num_blocks, kv.block_size, kv.num_kv_heads * kv.head_dim)
    chunk = Chunk(prompt[0].tolist(), 0, engine.pool.allocate(PROMPT_LEN // 4), PROMPT_LEN)
    feeds = dict(build_step([chunk], engine.block_size, engine.sliding_window).feeds)  # no group flags: TensorRT's
    feeds.update({name: np.zeros(shape, np.float32) for name in kv.key_inputs + kv.value_inputs})
    options = ort.SessionOptions()  # as written: ORT would fuse weight-only DQ→MatMul into int8-compute MatMulNBits
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    logits = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    qdq_vs_fq = np.abs(logits - ref["logits"]).max()
    print(f"{fmt} Q/DQ graph: |graph - fake-quant| {qdq_vs_fq:.3g}")
    assert_matches_fake_quant(fmt, logits, ref["logits"], ref["fp32"])


def test_per_token_format_with_the_last_mlp_left_float_matches_its_fake_quant_model(tiny, prompt, tmp_path):
    """The fp8_pc_pt recipe of docs/quantize.md (`--exclude` the last layer's MLP): those layers are float in the
    checkpoint and in both graphs (their inputs are not rounded per token), and both graphs reproduce ModelOpt's
    fake-quant model of that checkpoint."""
    ref: dict = {}

    def capture(model):
        with torch.no_grad():
            ref["logits"] = model(prompt).logits[0].numpy().copy()

    spec = QuantSpec("fp8_pc_pt", exclude=("model.layers.1.mlp.*",))
    quantize_checkpoint(tiny, tmp_path / "ckpt", spec, on_quantized=capture, **CALIB)
    with Checkpoint(tmp_path / "ckpt") as ckpt:
        for name, shape in (("gate_proj", (96, 64)), ("up_proj", (96, 64)), ("down_proj", (64, 96))):
            assert ckpt.quantized_linear(f"model.layers.1.mlp.{name}", *shape) is None
            assert ckpt.quantized_linear(f"model.layers.0.mlp.{name}", *shape) is not None
    manifest = build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=128, kv_block_size=4,
                                        max_num_tokens=64))
    assert manifest.quantization["quantized_linear_layers"] == 14 - 3
    graph = onnx.load(tmp_path / "engine" / "model.onnx", load_external_data=False).graph
    # inputs rounded per token: layer 0's q/k/v, o, gate and up (one rounding, merged), down; layer 1's q/k/v and o
    assert Counter(n.op_type for n in graph.node)["ReduceMax"] == 4 + 2
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    with torch.no_grad():
        fp32_logits = fp32(prompt).logits[0].numpy()
    assert np.abs(ref["logits"] - fp32_logits).max() > 1e-3
    engine = Engine(tmp_path / "engine", max_sequences=1)
    logits = engine.step([Chunk(prompt[0].tolist(), 0, engine.pool.allocate(PROMPT_LEN // 4), PROMPT_LEN)])
    assert_matches_fake_quant("fp8_pc_pt", logits, ref["logits"], fp32_logits)
    sequence = SequenceEngine(tmp_path / "engine")
    ids = prompt[0].tolist()
    sequence.start(PROMPT_LEN)
    rows = [sequence.feed(ids[:30], 0)] + [sequence.feed([t], 30 + i) for i, t in enumerate(ids[30:])]
    assert_matches_fake_quant("fp8_pc_pt", np.stack(rows), ref["logits"][29:], fp32_logits[29:])
    sequence.close()


def test_mixed_precision_checkpoint_builds_and_matches_its_fake_quant_model(tiny, prompt, tmp_path):
    """int8_sq_mixed: SmoothQuant W8A8 everywhere but down_proj, whose inputs stay float (W8A16), which ModelOpt's
    export writes as a MIXED_PRECISION checkpoint (a quant_algo per layer). Built with float compute it reproduces
    the fake-quant model; by default its W8A16 layers compute with int8 activations per block, like int8_wo."""
    ref: dict = {}

    def capture(model):
        with torch.no_grad():
            ref["logits"] = model(prompt).logits[0].numpy().copy()

    quantize_checkpoint(tiny, tmp_path / "ckpt", QuantSpec("int8_sq_mixed"), on_quantized=capture, **CALIB)
    hf_quant = json.loads((tmp_path / "ckpt" / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "MIXED_PRECISION"
    with Checkpoint(tmp_path / "ckpt") as ckpt:
        assert ckpt.quant_algos == ["W8A16", "W8A8_SQ_PER_CHANNEL"]
        down, gate = (ckpt.quantized_linear(f"model.layers.1.mlp.{n}", *s)
                      for n, s in (("down_proj", (64, 96)), ("gate_proj", (96, 64))))
        assert down.activation is None and down.input_scale is None and down.bits == 8
        assert gate.activation == "int8" and gate.input_scale is not None
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    with torch.no_grad():
        fp32_logits = fp32(prompt).logits[0].numpy()
    quant_effect = np.abs(ref["logits"] - fp32_logits).max()
    assert quant_effect > 1e-3
    limits = dict(max_seq_len=128, kv_block_size=4, max_num_tokens=64)
    results = {}
    for compute in ("float", "auto"):
        manifest = build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / compute, weight_only_compute=compute,
                                            **limits))
        record = manifest.quantization
        assert record["quant_algo"] == "MIXED_PRECISION" and record["quantized_linear_layers"] == 14
        assert record["layer_quant_algos"] == ["W8A16", "W8A8_SQ_PER_CHANNEL"]
        assert record["float_modules"] == ["lm_head", "model.embed_tokens"] and record["format"] == "int8_sq_mixed"
        engine = Engine(tmp_path / compute, max_sequences=1)
        results[compute] = engine.step([Chunk(prompt[0].tolist(), 0, engine.pool.allocate(PROMPT_LEN // 4),
                                              PROMPT_LEN)])
        sequence = SequenceEngine(tmp_path / compute)
        sequence.start(PROMPT_LEN)
        np.testing.assert_allclose(sequence.feed(prompt[0].tolist(), 0), results[compute][-1], atol=1e-4, rtol=0)
        sequence.close()
        assert record["activations"] == "int8 static per-tensor" + (
            "; int8 dynamic per block (MatMulNBits accuracy level 4)" if compute == "auto" else "")
    assert_matches_fake_quant("int8_sq", results["float"], ref["logits"], fp32_logits)
    int8_blocks = np.abs(results["auto"] - ref["logits"]).max()
    print(f"mixed: |int8-compute engine - fake-quant| {int8_blocks:.3g}, |fake-quant - fp32| {quant_effect:.3g}")
    assert 0 < int8_blocks < 0.5 * quant_effect


def test_a_checkpoints_quantized_head_is_lowered_as_its_other_layers(quantized, tmp_path):
    """ModelOpt excludes lm_head by default; a checkpoint that quantized it anyway (fp8 tensors, not in
    exclude_modules) gets its head lowered as its other fp8 layers, the input rounded with its scale (a review found
    it built from the dequantized weight alone, the input scale dropped, and called exact); the manifest says so.
    Against ModelOpt's fake-quant model: test_quantize_inputs.py."""
    import shutil

    from safetensors.torch import load_file, save_file

    fmt, result, _, _ = quantized
    if fmt != "fp8":
        pytest.skip("one format is enough")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(result.output, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    head = tensors["lm_head.weight"].float()
    scale = head.abs().max() / 448
    tensors["lm_head.weight"] = (head / scale).to(torch.float8_e4m3fn)
    tensors["lm_head.weight_scale"], tensors["lm_head.input_scale"] = scale, torch.tensor(0.05)
    save_file(tensors, ckpt / "model.safetensors")
    config = json.loads((ckpt / "hf_quant_config.json").read_text())
    config["quantization"]["exclude_modules"] = [m for m in config["quantization"]["exclude_modules"] if m != "lm_head"]
    (ckpt / "hf_quant_config.json").write_text(json.dumps(config))
    said: list[str] = []
    build_engine(BuildConfig(ckpt, tmp_path / "engine", max_seq_len=64), progress=said.append)
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())["quantization"]
    assert manifest["dequantized_linear_layers"] == [] and "lm_head" not in manifest["float_modules"]
    assert manifest["lm_head"] == {"dtype": "as the checkpoint quantized it", "lowering": LOWERINGS["fp8"]}
    assert not any("no kernel of this target takes" in line for line in said)
    tensors["lm_head.input_scale"] = torch.tensor(1e6)  # every input rounds to 0: so must every logit
    save_file(tensors, ckpt / "model.safetensors")
    build_engine(BuildConfig(ckpt, tmp_path / "zero", max_seq_len=64))
    engine = Engine(tmp_path / "zero", max_sequences=1)
    logits = engine.step([Chunk([5, 6, 7], 0, engine.pool.allocate(1), 3)])
    engine.close()
    assert logits.shape[-1] == 384 and not np.any(logits)
