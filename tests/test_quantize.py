"""Quantization: ModelOpt calibration → unified HF checkpoint → MatMulNBits engine, on tiny models.

References: ModelOpt's own fake-quantized model (weights and logits through transformers), captured just before
export. The engine must reproduce it: checkpoint weights dequantize to the fake-quantized weights, and the engine's
logits differ from the fake-quant model's by at most 10% of how far the fake-quant model is from float32.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
import transformers

from camshaft import cli
from camshaft.builder.build import build_engine
from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.config import BuildConfig
from camshaft.errors import CheckpointError
from camshaft.model_config import ModelConfig
from camshaft.quantize import calibration
from camshaft.quantize.calibration import default_corpus, read_corpus
from camshaft.quantize.modelopt_adapter import quantize_checkpoint
from camshaft.quantize.spec import FORMATS, QuantizeError, QuantSpec, modelopt_config, resolve_group_size
from camshaft.runtime.batch import Chunk
from camshaft.runtime.engine import Engine

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
            "int8_sq": "QuantizeLinear uint8 + MatMulInteger + Mul by input x weight scales",
            "w4a8_awq": "float8 input Q/DQ; int4 blocked DequantizeLinear, float8 Q/DQ of the weight; MatMul"}
MAX_BOUND = {"fp8": 448.0, "int8_sq": 127.0, "w4a8_awq": 448.0}  # ModelOpt's input_scale = amax / max bound


@pytest.fixture(scope="module", params=["int4_wo", "int8_wo", "int4_awq", "fp8", "int8_sq", "w4a8_awq"])
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
                if iq is not None and iq.is_enabled:
                    ref["input_amax"][name] = float(iq.amax)
                pqs = getattr(getattr(module, "input_quantizer", None), "pre_quant_scale", None)
                if pqs is not None:
                    ref["pqs"][name] = pqs.numpy().copy()

    result = quantize_checkpoint(tiny, root / "ckpt", QuantSpec(fmt), on_quantized=capture, **CALIB)
    build_engine(BuildConfig(root / "ckpt", root / "engine", max_seq_len=128, kv_block_size=4, max_num_tokens=64))
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
    if fmt == "int8_sq":  # SmoothQuant's per-channel scales stay beside every layer in ModelOpt's export
        assert len(ref["pqs"]) == 14


def test_engine_logits_match_modelopt_fake_quant_model(quantized, prompt):
    fmt, _, engine_dir, ref = quantized
    engine = Engine(engine_dir, max_sequences=1)
    manifest = engine.manifest.quantization
    assert manifest["format"] == fmt and manifest["lowering"] == LOWERING[fmt]
    activations = {"fp8": "fp8", "w4a8_awq": "fp8", "int8_sq": "int8"}.get(fmt)
    assert manifest["activations"] == (f"{activations} static per-tensor" if activations else None)
    assert manifest["quantized_linear_layers"] == 14
    assert manifest["float_modules"] == ["lm_head", "model.embed_tokens"]
    logits = engine.step([Chunk(prompt[0].tolist(), 0, engine.pool.allocate(PROMPT_LEN // 4), PROMPT_LEN)])
    engine_vs_fq = np.abs(logits - ref["logits"]).max()
    fq_vs_fp32 = np.abs(ref["logits"] - ref["fp32"]).max()
    print(f"{fmt}: |engine - fake-quant| {engine_vs_fq:.3g}, |fake-quant - fp32| {fq_vs_fp32:.3g}")
    assert fq_vs_fp32 > 1e-3  # the quantization is real
    assert engine_vs_fq <= 0.1 * fq_vs_fp32


def test_engine_stores_quantized_weights_and_runs_integer_kernels(quantized):
    """The artifact keeps 1-byte weights (no constant folding back to float); W8A8 runs ONNX Runtime's integer
    matmul; FP8 keeps its Q/DQ nodes (ONNX Runtime has no float8 matmul on the CPU)."""
    fmt, _, engine_dir, _ = quantized
    if fmt not in MAX_BOUND:
        pytest.skip("weight-only formats are MatMulNBits (checked by the manifest)")
    graph = onnx.load(engine_dir / "model.onnx", load_external_data=False)
    ops = Counter(n.op_type for n in graph.graph.node)
    elem = Counter(t.data_type for t in graph.graph.initializer if np.prod(t.dims) >= 64 * 32)
    # per layer: fused q/k/v, o, fused gate/up, down
    if fmt == "fp8":
        assert ops["QuantizeLinear"] == 8 and ops["DequantizeLinear"] == 16
        assert elem[onnx.TensorProto.FLOAT8E4M3FN] == 8
    elif fmt == "w4a8_awq":  # the int4 weight's DequantizeLinear, its float8 Q/DQ, the input's Q/DQ
        assert ops["QuantizeLinear"] == 16 and ops["DequantizeLinear"] == 24
        assert elem[onnx.TensorProto.INT4] == 8
    else:
        assert ops["MatMulInteger"] + ops["MatMulIntegerToFloat"] == 8 and ops["DequantizeLinear"] == 0
        assert elem[onnx.TensorProto.INT8] == 8


# --- bad input: clear errors, before any calibration ---


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if anything loads a model: the errors below must come first."""
    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded before the input was checked")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_unknown_format_lists_the_formats():
    with pytest.raises(QuantizeError, match="unknown quantization format 'int3'") as info:
        QuantSpec("int3")
    for name in FORMATS:
        assert name in str(info.value)
    with pytest.raises(QuantizeError, match="KV cache dtype"):
        QuantSpec("fp8", kv_cache_dtype="int4")


def test_group_size_rules(tiny, tmp_path, no_model_load):
    model = ModelConfig.from_hf_dir(tiny)
    assert resolve_group_size(QuantSpec("int4_wo"), model) == 32
    assert resolve_group_size(QuantSpec("int4_awq", group_size="32"), model) == 32
    assert resolve_group_size(QuantSpec("int8_wo"), model) is None
    with pytest.raises(QuantizeError, match="group size 64 does not divide down_proj.*=96; use --group-size 32"):
        quantize_checkpoint(tiny, tmp_path / "out", QuantSpec("int4_wo", group_size=64), **CALIB)
    with pytest.raises(QuantizeError, match="not supported"):
        QuantSpec("int4_wo", group_size=48)
    with pytest.raises(QuantizeError, match="applies only to blockwise"):
        QuantSpec("int8_wo", group_size=64)
    assert not (tmp_path / "out").exists()


def test_smollm2_dims_pick_group_64():
    smollm2 = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                   num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, vocab_size=49152)
    assert resolve_group_size(QuantSpec("int4_awq"), ModelConfig.from_hf(smollm2)) == 64
    with pytest.raises(QuantizeError, match="group size 128 does not divide"):
        resolve_group_size(QuantSpec("int4_awq", group_size=128), ModelConfig.from_hf(smollm2))


def test_bad_calibration_data_is_refused_before_loading(tiny, tmp_path, no_model_load):
    spec = QuantSpec("int4_wo")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(QuantizeError, match="is empty"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data=empty, **CALIB)
    with pytest.raises(QuantizeError, match="does not exist"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data=tmp_path / "missing.jsonl", **CALIB)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(QuantizeError, match="holds no"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data=tmp_path / "emptydir", **CALIB)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"nope": 1}\n')
    with pytest.raises(QuantizeError, match=r"bad.jsonl:2"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data=bad, **CALIB)
    with pytest.raises(QuantizeError, match="--calib-size"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_size=0)
    (tmp_path / "notempty").mkdir()
    (tmp_path / "notempty" / "keep.txt").write_text("x")
    with pytest.raises(QuantizeError, match="refusing to overwrite"):
        quantize_checkpoint(tiny, tmp_path / "notempty", spec, **CALIB)


def test_too_little_calibration_text(tiny, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("just a few words")
    with pytest.raises(QuantizeError, match="fewer than --calib-size 4 x --calib-seq-len 64"):
        quantize_checkpoint(tiny, tmp_path / "o", QuantSpec("int4_wo"), calib_data=short, **CALIB)


def test_user_corpus_formats(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n"two"\n\n')
    assert read_corpus(tmp_path) == ["plain text", "one", "two"]


def test_default_corpus_is_deterministic_stdlib_docstrings():
    first, second = default_corpus(), default_corpus()
    assert first == second
    assert len(first) > 500 and sum(map(len, first)) > 200_000
    assert "Return" in " ".join(first[:50]) or "return" in " ".join(first[:50])
    assert calibration.STDLIB_MODULES[0] == "abc"


def test_modelopt_config_applies_group_kv_and_exclude():
    cfg = modelopt_config(QuantSpec("int4_awq", kv_cache_dtype="fp8", exclude=("*.mlp.down_proj",)), 64)
    entries = cfg["quant_cfg"]
    blocks = [e["cfg"]["block_sizes"][-1] for e in entries if isinstance(e.get("cfg"), dict)
              and "block_sizes" in e["cfg"]]
    assert blocks == [64]
    assert {"quantizer_name": "*.mlp.down_proj*_quantizer", "enable": False} == entries[-1]
    assert entries[-2]["quantizer_name"] == "*[kv]_bmm_quantizer"


def test_unsupported_quantized_checkpoint_is_refused_by_the_builder(tiny, tmp_path):
    quantize_checkpoint(tiny, tmp_path / "fp8", QuantSpec("fp8"), **CALIB)
    config = tmp_path / "fp8" / "hf_quant_config.json"
    raw = json.loads(config.read_text())
    config.write_text(json.dumps({**raw, "quantization": {**raw["quantization"], "quant_algo": "NVFP4"}}))
    with pytest.raises(CheckpointError, match="quantized as NVFP4; camshaft builds W4A16_AWQ, W8A16, FP8"):
        Checkpoint(tmp_path / "fp8")


def test_excluded_layers_stay_float(tiny, tmp_path, prompt):
    spec = QuantSpec("int4_wo", exclude=("*.mlp.down_proj", "model.layers.1.self_attn.k_proj"))
    quantize_checkpoint(tiny, tmp_path / "ckpt", spec, **CALIB)
    with Checkpoint(tmp_path / "ckpt") as ckpt:
        assert ckpt.quantized_linear("model.layers.0.mlp.down_proj", 64, 96) is None
        assert ckpt.quantized_linear("model.layers.1.self_attn.k_proj", 32, 64) is None
        assert ckpt.quantized_linear("model.layers.1.self_attn.q_proj", 64, 64) is not None
    manifest = build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=64, kv_block_size=4))
    # layer 0: q k v (fused), o, gate up (fused) = 6; layer 1: q, v, o, gate up = 5; no down_proj
    assert manifest.quantization["quantized_linear_layers"] == 6 + 5


def test_cli_quantize(tiny, tmp_path, capsys):
    def camshaft(*args):
        argv, sys.argv = sys.argv, ["camshaft", *map(str, args)]
        try:
            cli.main()
            return 0
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.argv = argv

    started = time.perf_counter()
    code = camshaft("quantize", "--model", tiny, "--quant", "int4_wo", "--group-size", "64", "--output", tmp_path / "o")
    assert code == 1 and "group size 64 does not divide" in capsys.readouterr().err
    assert time.perf_counter() - started < 5
    code = camshaft("quantize", "--model", tiny, "--quant", "int8_wo", "--calib-size", "2", "--calib-seq-len", "32",
                    "--output", tmp_path / "o")
    assert code == 0
    assert json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "W8A16"
    assert (tmp_path / "o" / "tokenizer.json").is_file()
