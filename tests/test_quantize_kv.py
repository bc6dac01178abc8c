"""Quantized KV cache (int8, fp8 e4m3): quantized on the ScatterND write with the checkpoint's per-layer scales,
dequantized after the block-table Gather; the pool holds 1 byte an element.

Reference: ModelOpt's fake-quant model through transformers with its K/V quantizers on (and off, to measure what the
KV quantization alone changes). The prompt is prefilled in two chunks so the second reads the first's K/V back from
the quantized pool, then one token is decoded (the decode attention group reads the pool too). The quantizers are
affine: a static bias per KV head and channel is subtracted before rounding and added back after.

Rounding ties: where a K/V value sits exactly between two grid values in ModelOpt's forward, the engine's value of
the same element (ONNX Runtime's matmuls, not torch's, one float rounding apart) can fall on the other side and round
the other way; one such element moves the tiny model's logits by several % of the KV effect. So every K/V element the
engine stored is compared with ModelOpt's: those that differ must be such ties (and rare), and the logits are
compared with the fake-quant model run with the engine's K/V at those elements.
"""

from __future__ import annotations

import copy
from pathlib import Path

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from camshaft.builder.build import build_engine
from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.config import BuildConfig
from camshaft.builder.graph.kv_quant import KVQuantizer, e4m3_values
from camshaft.builder.graph.ops import GraphWriter
from camshaft.errors import CapacityError, CheckpointError, EngineError
from camshaft.quantize.modelopt_adapter import quantize_checkpoint
from camshaft.quantize.spec import QuantSpec
from camshaft.runtime.batch import Chunk
from camshaft.runtime.engine import Engine
from camshaft.runtime.kv_cache import bytes_per_block
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model

pytest.importorskip("modelopt.torch.quantization")

PROMPT_LEN, FIRST_CHUNK, BLOCK = 40, 24, 4
CALIB = dict(calib_size=4, calib_seq_len=64)
STORAGE = {"int8": np.int8, "float8": np.uint8}


def test_e4m3_codes_round_trip_every_value(tmp_path):
    """The float8 cache's write (QuantizeLinear-rounded value → bit pattern) and read (bit pattern → value x scale)
    agree with ml_dtypes on every e4m3fn value, on values between them and beyond the range (saturated)."""
    finite = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = finite[np.isfinite(finite)]
    rng = np.random.default_rng(0)
    between = rng.uniform(-448, 448, 2000).astype(np.float32) * rng.choice([1, 1e-2, 1e-4], 2000).astype(np.float32)
    x = np.concatenate([finite, between, np.float32([500, -1e6, 3e-5])])[None]
    scale = 0.37
    with open(tmp_path / "w.data", "wb") as data:
        g = GraphWriter(data, "w.data")
        kv = KVQuantizer(g, "float8", np.float32)
        g.op_to("Identity", [kv.write("x", scale)], "code")
        g.op_to("Identity", [kv.read("code", scale, "t")], "back")
        g.input("x", TensorProto.FLOAT, [1, "n"])
        g.output("code", TensorProto.UINT8, [1, "n"])
        g.output("back", TensorProto.FLOAT, [1, "n"])
    model = g.model(23)
    model.graph.ClearField("initializer")
    model.graph.initializer.extend([t for t in g.initializers if not t.external_data])
    table = np.nan_to_num(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    model.graph.initializer.append(helper.make_tensor("t.e4m3_table", TensorProto.FLOAT, [256], table * 0.37))
    code, back = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})
    expected = np.clip(x / np.float32(scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(code, expected.view(np.uint8) & np.where(expected == 0, 0x7F, 0xFF))
    np.testing.assert_array_equal(back, expected.astype(np.float32) * np.float32(scale))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("kv") / "hf")


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 384, (1, PROMPT_LEN + 1), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=[("int8_wo", "int8"), ("fp8", "fp8"), ("int8_wo", "fp8")])
def kv_engine(request, tiny, prompt, tmp_path_factory):
    fmt, kv_dtype = request.param
    root = tmp_path_factory.mktemp(f"{fmt}-kv-{kv_dtype}")
    ref: dict = {}

    def capture(model):
        quantizers = [q for m in model.modules() for n in ("k_bmm_quantizer", "v_bmm_quantizer")
                      if (q := getattr(m, n, None)) is not None and q.is_enabled]
        assert len(quantizers) == 4  # K and V of 2 layers
        ref["amax"] = [float(q.amax) for q in quantizers]  # layer 0 K, V, layer 1 K, V
        ref["bias"] = [q._bias_value.reshape(-1).numpy().copy() for q in quantizers]
        ref["model"] = copy.deepcopy(model)  # for the tie-aligned reference
        ref["kv"] = {}
        hooks = [q.register_forward_hook(lambda _q, i, out, k=k: ref["kv"].__setitem__(k, (i[0], out)))
                 for k, q in enumerate(quantizers)]
        with torch.no_grad():
            ref["logits"] = model(prompt).logits[0].numpy().copy()
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for q in quantizers:
                q.disable()
            ref["float_kv"] = model(prompt).logits[0].numpy().copy()
            for q in quantizers:
                q.enable()

    quantize_checkpoint(tiny, root / "ckpt", QuantSpec(fmt, kv_cache_dtype=kv_dtype), on_quantized=capture, **CALIB)
    compute = "float" if fmt == "int8_wo" else "auto"  # the weights exact: this checks the KV cache
    build_engine(BuildConfig(root / "ckpt", root / "engine", max_seq_len=128, kv_block_size=BLOCK, max_num_tokens=64,
                             weight_only_compute=compute))
    with Checkpoint(root / "ckpt") as ckpt:
        assert ckpt.quantization["kv_cache_quant_algo"] == kv_dtype.upper()
        scales = [s for layer in range(2) for s in ckpt.kv_scales(layer)]
    bound = {"int8": 127.0, "fp8": 448.0}[kv_dtype]  # ModelOpt's FP8 export and camshaft's INT8 one: amax / bound
    np.testing.assert_allclose(scales, np.array(ref["amax"]) / bound, rtol=1e-6)
    ref["scales"] = scales
    return kv_dtype, root / "engine", ref


def test_engine_logits_match_fake_quant_kv_cache(kv_engine, prompt):
    kv_dtype, engine_dir, ref = kv_engine
    engine = Engine(engine_dir, max_sequences=1)
    q = engine.manifest.quantization
    element = {"int8": "int8", "fp8": "float8"}[kv_dtype]  # the pool's element; the record keeps the flag's word
    assert q["kv_cache_dtype"] == kv_dtype and engine.manifest.kv_cache.dtype == element
    assert q["kv_cache_affine"] is True
    from camshaft.runtime.engine_info import engine_info

    assert engine_info(engine_dir)["quantization"]["kv_cache_affine"] is True  # inspect tells it from a plain cache
    tokens, blocks = prompt[0].tolist(), engine.pool.allocate(PROMPT_LEN // BLOCK + 1)
    first = engine.step([Chunk(tokens[:FIRST_CHUNK], 0, blocks[: FIRST_CHUNK // BLOCK], FIRST_CHUNK)])
    second = engine.step([Chunk(tokens[FIRST_CHUNK:PROMPT_LEN], FIRST_CHUNK, blocks[:-1], PROMPT_LEN - FIRST_CHUNK)])
    decode = engine.step([Chunk(tokens[PROMPT_LEN:], PROMPT_LEN, blocks, 1)])
    logits = np.concatenate([first, second, decode])
    with Checkpoint(engine_dir.parent / "ckpt") as ckpt:  # the affine biases reach the checkpoint unchanged
        biases = [b for layer in range(2) for b in ckpt.kv_biases(layer)]
    for got, expected in zip(biases, ref["bias"], strict=True):
        np.testing.assert_array_equal(got, expected)
    stored = engine_kv(engine, blocks, ref["scales"], biases, kv_dtype, PROMPT_LEN + 1)
    ties, aligned = 0, {}
    for k, (x, out) in ref["kv"].items():  # quantizer input / output: [1, heads, tokens, dim]
        fake = out[0].transpose(0, 1).reshape(PROMPT_LEN + 1, -1).numpy()
        ties += count_ties(x[0].transpose(0, 1).reshape(PROMPT_LEN + 1, -1).numpy(), fake, stored[k], biases[k],
                           ref["scales"][k])
        aligned[k] = torch.from_numpy(stored[k]).reshape(PROMPT_LEN + 1, out.shape[1], -1).transpose(0, 1)[None]
    quantizers = [q for m in ref["model"].modules() for n in ("k_bmm_quantizer", "v_bmm_quantizer")
                  if (q := getattr(m, n, None)) is not None and q.is_enabled]
    hooks = [q.register_forward_hook(lambda _q, _i, _o, k=k: aligned[k]) for k, q in enumerate(quantizers)]
    with torch.no_grad():
        reference = ref["model"](prompt).logits[0].numpy()
    for hook in hooks:
        hook.remove()
    engine_vs_fq = np.abs(logits - reference).max()
    kv_effect = np.abs(ref["logits"] - ref["float_kv"]).max()
    print(f"kv {kv_dtype}: |engine - fake-quant| {engine_vs_fq:.3g}, |fake-quant - same with float KV| {kv_effect:.3g}"
          f"; K/V elements rounded the other way at a tie: {ties} of {4 * stored[0].size}")
    assert kv_effect > 1e-3  # the KV quantization is real
    assert engine_vs_fq <= 0.1 * kv_effect
    assert ties <= 4  # a handful at most
    if not ties:
        assert np.abs(logits - ref["logits"]).max() <= 0.1 * kv_effect


def engine_kv(engine: Engine, blocks: list[int], scales: list[float], biases: list, kv_dtype: str,
              tokens: int) -> list[np.ndarray]:
    """The engine's K/V pools dequantized: [tokens, kv_heads * dim] per layer and K/V, in the quantizers' order."""
    n = len(engine.backend.caches) // 2
    out = []
    for layer in range(n):
        for cache in (engine.backend.caches[layer], engine.backend.caches[n + layer]):
            codes = cache[blocks].reshape(-1, cache.shape[-1])[:tokens]
            values = (e4m3_values()[codes] if kv_dtype == "fp8" else codes.astype(np.float32))
            out.append(values * np.float32(scales[len(out)]) + biases[len(out)])
    return out


def count_ties(x: np.ndarray, fake: np.ndarray, stored: np.ndarray, bias: np.ndarray, scale: float) -> int:
    """Elements where the engine's K/V differ from ModelOpt's; each must be a rounding tie: ModelOpt's input lies
    within 1e-3 of a step from the midpoint of the two grid values."""
    differ = np.abs(fake - stored) > 1e-5 * (1 + np.abs(fake))
    if not differ.any():
        return 0
    z = ((x - bias) / scale)[differ]
    a, b = ((fake - bias) / scale)[differ], ((stored - bias) / scale)[differ]
    assert np.all(np.abs(z - (a + b) / 2) <= 1e-3 * np.abs(a - b)), f"not rounding ties: {z}, {a}, {b}"
    return int(differ.sum())


def test_pool_holds_one_byte_an_element(kv_engine, tiny, tmp_path):
    kv_dtype, engine_dir, _ = kv_engine
    engine = Engine(engine_dir, max_sequences=2)
    float_engine = build_engine(BuildConfig(tiny, tmp_path / "f", max_seq_len=128, kv_block_size=BLOCK))
    kv = engine.manifest.kv_cache
    assert bytes_per_block(engine.manifest) * 4 == bytes_per_block(float_engine) == 2 * 2 * BLOCK * 2 * 16 * 4
    caches = engine.backend.caches
    assert len(caches) == 4 and all(c.dtype == STORAGE[kv.dtype] for c in caches)
    assert engine.backend.kv_cache_bytes == engine.pool.num_blocks * bytes_per_block(engine.manifest)


def test_int8_kv_scales_join_a_sharded_checkpoint(tmp_path):
    """The INT8 scales file is added to a sharded checkpoint's index, and the configs name the INT8 KV cache."""
    import json

    from camshaft.quantize.kv_scales import KV_SCALES_FILE, mark_int8_kv_cache, write_kv_tensors

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "m-1.safetensors"}}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": None}}))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_algo": "W8A16"}}))
    write_kv_tensors(tmp_path, {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5)})
    mark_int8_kv_cache(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {"a.weight": "m-1.safetensors", "model.layers.0.self_attn.k_proj.k_scale": KV_SCALES_FILE}
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "INT8"
    scheme = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme == {"dynamic": False, "num_bits": 8, "type": "int"}


def with_kv_scales(kv_engine, tmp_path, edit) -> Path:
    """A copy of the int8 KV checkpoint whose scales file (its own small file) holds edit(its tensors)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from camshaft.quantize.kv_scales import KV_SCALES_FILE

    if kv_engine[0] != "int8":
        pytest.skip("the INT8 scales sit in their own small file, easy to edit")
    ckpt = shutil.copytree(kv_engine[1].parent / "ckpt", tmp_path / "ckpt")
    save_file(edit(load_file(ckpt / KV_SCALES_FILE)), ckpt / KV_SCALES_FILE)
    return ckpt


def test_kv_scales_under_vllm_names(kv_engine, tmp_path):
    """A checkpoint naming its scales self_attn.k_scale / v_scale (vLLM's convention) reads the same."""
    ckpt = with_kv_scales(kv_engine, tmp_path, lambda tensors: {
        k.replace(".k_proj.k_scale", ".k_scale").replace(".v_proj.v_scale", ".v_scale"): v for k, v in tensors.items()})
    with Checkpoint(ckpt) as renamed:
        assert [s for layer in range(2) for s in renamed.kv_scales(layer)] == kv_engine[2]["scales"]


def test_kv_scales_missing_say_what_the_cache_needs(kv_engine, tmp_path):
    """A KV cache quantized by hf_quant_config.json without its scales: which tensor, and the two ways out."""
    ckpt = with_kv_scales(kv_engine, tmp_path, lambda tensors: {
        k: v for k, v in tensors.items() if "layers.1.self_attn.v" not in k})
    with Checkpoint(ckpt) as scaled, pytest.raises(CheckpointError, match=(
            r"quantizes the KV cache \(kv_cache_quant_algo in hf_quant_config.json\) but holds no "
            r"model\.layers\.1\.self_attn\.v_proj\.v_scale \(nor model\.layers\.1\.self_attn\.v_scale\).*remove "
            r"kv_cache_quant_algo")):
        scaled.kv_scales(1)


def test_a_quantized_kv_cache_keeps_the_session_on_the_batch_graph(kv_engine):
    """The sequence graph keeps a float cache, so an engine with an int8/fp8 cache is built without one."""
    _, engine_dir, _ = kv_engine
    session = Session(engine_dir)
    assert session.manifest.sequence_graph is None and session.graph == "batch"
    assert not any(path.name.startswith("sequence") for path in engine_dir.iterdir())
    with pytest.raises(EngineError, match=r"has no sequence graph \(its KV cache is (int8|float8); the sequence "
                                          r"graph keeps a float cache\); run its batch graph"):
        Session(engine_dir, graph="sequence")
    session.close()
    tight = Session(engine_dir, kv_cache_memory=4 * bytes_per_block(session.manifest))
    with pytest.raises(CapacityError, match="the request needs 60 tokens of KV cache; the budget holds .* raise "
                                            "kv_cache_memory or lower max_tokens"):
        tight.generate(list(range(10, 30)), max_tokens=40)
    tight.close()


def test_a_checkpoint_that_quantizes_only_its_kv_cache_builds(tiny, tmp_path):
    """ModelOpt writes quant_algo null with a kv_cache_quant_algo when only the K/V quantizers are on: float layers
    and an fp8 cache, which the onnxruntime target builds and the TensorRT targets refuse by name."""
    import json
    import shutil

    from camshaft.errors import BuildConfigError
    from camshaft.quantize.kv_scales import write_kv_tensors

    ckpt = shutil.copytree(tiny, tmp_path / "kv-only")
    (ckpt / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8", "quantized_layers": {}}}))
    write_kv_tensors(ckpt, {f"model.layers.{i}.self_attn.{p}_proj.{p}_scale": torch.tensor(0.02)
                            for i in range(2) for p in "kv"})
    limits = dict(max_seq_len=128, kv_block_size=BLOCK, max_num_tokens=64)
    manifest = build_engine(BuildConfig(ckpt, tmp_path / "engine", **limits))
    build_engine(BuildConfig(tiny, tmp_path / "float", **limits))
    quant = manifest.quantization
    assert manifest.kv_cache.dtype == "float8" and quant["quant_algo"] is None
    assert quant["quantized_linear_layers"] == 0 and quant["kv_cache_quant_algo"] == "FP8"
    prompt = list(range(5, 45))
    with Session(tmp_path / "engine") as kv, Session(tmp_path / "float", graph="batch") as plain:
        quantized = kv.generate(prompt, max_tokens=1, logprobs=0).logprobs[0]
        exact = plain.generate(prompt, max_tokens=1, logprobs=0).logprobs[0]
    assert quantized.token_id == exact.token_id and 0 < abs(quantized.logprob - exact.logprob) < 0.05
    with pytest.raises(BuildConfigError, match="cannot build a KV cache in fp8: camshaft lowers quantized KV caches"):
        build_engine(BuildConfig(ckpt, tmp_path / "rtx", target="tensorrt-rtx", **limits))
    (ckpt / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "FP8"}}))
    assert build_engine(BuildConfig(ckpt, tmp_path / "no-key", **limits)).kv_cache.dtype == "float8"  # key left out
    (ckpt / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": None}}))
    with pytest.raises(Exception, match="quantizes nothing"):
        build_engine(BuildConfig(ckpt, tmp_path / "nothing", **limits))
