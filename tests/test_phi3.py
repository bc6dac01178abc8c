"""Phi-3: Llama's layers with q/k/v and gate/up each stored as one matrix, float (numerics also in test_parity.py's
variant "phi3-fused") and quantized by ModelOpt as one; what it does not support is refused, saying so."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CheckpointError, UnsupportedModelError
from camshaft.model_config import ModelConfig
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return make_tiny_model("phi3-fused", tmp_path_factory.mktemp("phi3") / "hf")


def edited(model, tmp_path, **changes):
    out = tmp_path / "edited"
    out.mkdir(parents=True)
    for f in model.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    if {"rope_scaling", "partial_rotary_factor"} & set(changes):  # as Phi-3/4 checkpoints write them (transformers 5
        # saves rope_parameters, whose own partial_rotary_factor would win)
        config.pop("rope_parameters", None)
    (out / "config.json").write_text(json.dumps(config | changes))
    return out


def test_a_phi3_checkpoint_reads_as_llama_layers_with_its_window(phi3):
    c = ModelConfig.from_hf_dir(phi3)
    assert (c.architecture, c.sliding_window, c.attention_window, c.qkv_bias) == ("phi3", 40, 40, False)
    weights = load_file(phi3 / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights and "model.layers.0.mlp.gate_up_proj.weight" in weights


def test_a_phi3_engine_generates_what_transformers_does(phi3, tmp_path):
    import torch
    import transformers

    build_engine(BuildConfig(phi3, tmp_path / "engine", max_seq_len=96))
    ids = list(range(5, 30))
    model = transformers.AutoModelForCausalLM.from_pretrained(phi3).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, min_new_tokens=40)
    got = Session(tmp_path / "engine").generate(ids, max_tokens=40, ignore_eos=True).token_ids
    assert got == expected[0, len(ids):].tolist()  # past the window of 40 too


@pytest.mark.parametrize(("factor", "message"), [
    (0.1875, "rotates 3 of head_dim 16's dimensions; it must be a positive even number"),
    (1.5, r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
])
def test_a_partial_rotary_that_transformers_could_not_run_is_refused(phi3, tmp_path, factor, message):
    """Phi-4-mini rotates 3/4 of each head (numerics: test_parity.py's "phi4-mini-partial")."""
    partial = edited(phi3, tmp_path / "ok", partial_rotary_factor=0.75)
    assert ModelConfig.from_hf_dir(partial).rotary_dim == 12
    build_engine(BuildConfig(partial, tmp_path / "engine", max_seq_len=64))
    from camshaft.runtime.engine_info import engine_info, info_lines

    assert "over 12 of each head's dimensions" in "\n".join(info_lines(engine_info(tmp_path / "engine")))
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf_dir(edited(phi3, tmp_path, partial_rotary_factor=factor))


def test_phi3_as_microsoft_ships_it_builds_and_reads_its_own_defaults(phi3, tmp_path):
    """Phi-3's repositories keep the auto_map of the remote code transformers has since taken in (the same class):
    transformers runs its own, and so does camshaft. Without rms_norm_eps, Phi3Config's 1e-5 (not Llama's 1e-6);
    layer_types, which Phi3Model ignores, are ignored."""
    model = edited(phi3, tmp_path, auto_map={"AutoConfig": "configuration_phi3.Phi3Config",
                                             "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
                   layer_types=["full_attention", "sliding_attention"], rms_norm_eps=None)
    c = ModelConfig.from_hf_dir(model)
    assert (c.rms_norm_eps, c.layer_types, c.attention_window) == (1e-5, ("sliding", "sliding"), 40)
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))
    assert Session(tmp_path / "engine").generate([5, 6, 7], max_tokens=4, ignore_eos=True).token_ids
    evil = edited(phi3, tmp_path / "evil", auto_map={"AutoModelForCausalLM": "modeling_x.MyPhi3ForCausalLM"})
    with pytest.raises(UnsupportedModelError, match="asks for custom modelling code"):
        ModelConfig.from_hf_dir(evil)


@pytest.mark.parametrize("stored", ["missing", "apart"])
def test_a_missing_or_unfused_matrix_is_named(phi3, tmp_path, stored):
    model = edited(phi3, tmp_path)
    weights = load_file(model / "model.safetensors")
    qkv = weights.pop("model.layers.1.self_attn.qkv_proj.weight")
    if stored == "apart":  # transformers would leave qkv_proj random and ignore these
        weights |= {f"model.layers.1.self_attn.{n}_proj.weight": w for n, w in zip("qkv", np.split(qkv, [64, 96]),
                                                                                     strict=True)}
    save_file(weights, model / "model.safetensors")
    message = ("tensor 'model.layers.1.self_attn.qkv_proj.weight' is missing" if stored == "missing" else
               "layer 1 stores model.layers.1.self_attn.q_proj.weight, .* apart, but phi3 reads one "
               "model.layers.1.self_attn.qkv_proj.weight")
    with pytest.raises(CheckpointError, match=message):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))


def test_a_fused_matrix_of_the_wrong_size_names_itself(phi3, tmp_path):
    model = edited(phi3, tmp_path)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.mlp.gate_up_proj.weight"] = weights["model.layers.1.mlp.gate_up_proj.weight"][:-2]
    save_file(weights, model / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.gate_up_proj.weight' has shape \(190, 64\), "
                                              r"expected \(192, 64\)"):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))


@pytest.mark.parametrize("fmt", ["fp8", "int8_sq", "int4_awq"])
def test_a_quantized_phi3_engine_matches_modelopts_fake_quant_model(phi3, tmp_path, fmt):
    """ModelOpt quantizes the fused matrices as one (one input scale, per-row weight scales over all of q/k/v): the
    engine reads their rows per part and gives the fake-quant model's logits (test_quantize.py's bar)."""
    import torch
    import transformers

    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec
    from camshaft.runtime.batch import Chunk
    from camshaft.runtime.engine import Engine

    pytest.importorskip("modelopt.torch.quantization")
    prompt = torch.randint(3, 384, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = {}

    def capture(model):
        with torch.no_grad():
            ref["logits"] = model(prompt).logits[0].numpy().copy()

    quantize_checkpoint(phi3, tmp_path / "q", QuantSpec(fmt), on_quantized=capture, calib_size=4, calib_seq_len=64)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    build_engine(BuildConfig(tmp_path / "q", tmp_path / "engine", max_seq_len=64, kv_block_size=4))
    engine = Engine(tmp_path / "engine", max_sequences=1)
    assert engine.manifest.quantization["quantized_linear_layers"] == 2 * 7  # q k v o gate up down, 2 layers
    logits = engine.step([Chunk(prompt[0].tolist(), 0, engine.pool.allocate(12), 48)])
    with torch.no_grad():
        fp32 = transformers.AutoModelForCausalLM.from_pretrained(phi3).eval()(prompt).logits[0].numpy()
    assert np.abs(ref["logits"] - fp32).max() > 1e-3  # the quantization is real
    bar = 0.1 * np.abs(ref["logits"] - fp32).max()
    assert np.abs(logits - ref["logits"]).max() <= bar
    from camshaft.runtime.sequence import SequenceEngine

    sequence = SequenceEngine(tmp_path / "engine")  # the Session's graph, from the same checkpoint reading
    sequence.start(48)
    assert np.abs(sequence.feed(prompt[0].tolist(), 0) - ref["logits"][-1]).max() <= bar
    sequence.close()
