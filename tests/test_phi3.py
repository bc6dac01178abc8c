"""Phi-3: Llama's layers with q/k/v and gate/up each stored as one matrix (numerics in test_parity.py's variant
"phi3-fused"); what it does not support yet is refused before any work, saying so."""

from __future__ import annotations

import json
import re

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
    out.mkdir()
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


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
      "original_max_position_embeddings": 256}, "rope scaling 'longrope' is not supported"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "'su' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}},
     "Phi-3's long-context rope (longrope"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
])
def test_what_phi3_models_need_beyond_that_is_refused(phi3, tmp_path, changes, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        ModelConfig.from_hf_dir(edited(phi3, tmp_path, **changes))


def test_a_fused_matrix_of_the_wrong_size_names_itself(phi3, tmp_path):
    model = edited(phi3, tmp_path)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.mlp.gate_up_proj.weight"] = weights["model.layers.1.mlp.gate_up_proj.weight"][:-2]
    save_file(weights, model / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.gate_up_proj.weight' has shape \(190, 64\), "
                                              r"expected \(192, 64\)"):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))


def test_quantizing_phi3_is_refused_before_calibrating(phi3, tmp_path):
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantizeError, QuantSpec

    with pytest.raises(QuantizeError, match="quantizing phi3 .* is not supported yet; build the float checkpoint"):
        quantize_checkpoint(phi3, tmp_path / "q", QuantSpec("fp8"))
    assert not (tmp_path / "q").exists()
