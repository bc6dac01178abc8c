"""Which safetensors files a checkpoint's weights come from, and the files that would make an engine disagree with
transformers refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from camshaft.builder.checkpoint import Checkpoint
from camshaft.errors import CheckpointError

from tiny_models import make_tiny_model

NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("ckpt") / "hf")


@pytest.fixture()
def copy(tiny, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(tiny, out)
    return out


def test_model_safetensors_beside_an_index_of_other_shards_is_refused(copy):
    """transformers reads model.safetensors whatever index lies beside it (a sharded checkpoint saved again unsharded
    into the same directory), while the index is how camshaft finds shards: refused until one goes. An index naming
    model.safetensors itself is fine."""
    weights = load_file(str(copy / "model.safetensors"))
    save_file({**weights, NORM: np.zeros_like(weights[NORM])}, str(copy / "model-00001-of-00001.safetensors"))
    index = copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": dict.fromkeys(weights, "model-00001-of-00001.safetensors")}))
    with pytest.raises(CheckpointError, match="holds model.safetensors and an index of other shards "
                                              r"\(model-00001-of-00001.safetensors\).*Remove the one that is stale"):
        Checkpoint(copy)
    (copy / "model-00001-of-00001.safetensors").unlink()
    index.write_text(json.dumps({"weight_map": dict.fromkeys(weights, "model.safetensors")}))
    with Checkpoint(copy) as checkpoint:
        assert checkpoint.files == [copy / "model.safetensors"]
        np.testing.assert_array_equal(checkpoint.get(NORM, weights[NORM].shape), weights[NORM])


def test_a_tensor_stored_in_two_files_is_refused_naming_both(copy):
    weights = load_file(str(copy / "model.safetensors"))
    (copy / "model.safetensors").rename(copy / "weights.safetensors")
    save_file({NORM: np.zeros_like(weights[NORM])}, str(copy / "zz-extra.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor '{NORM}' is stored twice, in weights.safetensors and "
                                              "zz-extra.safetensors"):
        Checkpoint(copy)


def test_a_quant_config_over_float_weights_is_refused(copy):
    (copy / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(CheckpointError, match="says the layers are FP8, but no layer has a weight_scale"):
        Checkpoint(copy)


@pytest.mark.parametrize("quantization, message", [
    ({"quant_algo": ["FP8"]}, r"is quantized as \['FP8'\]"),
    ({"quant_algo": None, "kv_cache_quant_algo": ["FP8"]}, r"quantizes the KV cache as \['FP8'\]"),
])
def test_badly_typed_quant_configs_are_clear_errors(copy, quantization, message):
    (copy / "hf_quant_config.json").write_text(json.dumps({"quantization": quantization}))
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(copy)


def test_a_camshaft_quantize_record_that_is_not_an_object_is_refused(copy):
    from camshaft.model_config import CAMSHAFT_QUANT_RECORD

    weights = load_file(str(copy / "model.safetensors"))
    save_file({**weights, "model.layers.0.mlp.up_proj.weight_scale": np.ones(1, np.float32)},
              str(copy / "model.safetensors"))
    (copy / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    (copy / CAMSHAFT_QUANT_RECORD).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is malformed: an object of camshaft quantize's settings, not list"):
        Checkpoint(copy)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda w, c: w.pop("model.layers.1.mlp.down_proj.weight"),
     "tensor 'model.layers.1.mlp.down_proj.weight' is missing"),
    (lambda w, c: w.update({"model.layers.1.mlp.down_proj.weight": w["model.layers.1.mlp.down_proj.weight"][:, :90]}),
     r"'model.layers.1.mlp.down_proj.weight' has shape \(64, 90\), expected \(64, 96\)"),
    (lambda w, c: c.update(intermediate_size=100), r"'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\), "
                                                    r"expected \(100, 64\)"),
    (lambda w, c: c.update(vocab_size=400), r"'model.embed_tokens.weight' has shape \(384, 64\), expected \(400, 64\)"),
    (lambda w, c: c.update(attention_bias=True), "tensor 'model.layers.0.self_attn.q_proj.bias' is missing"),
])
def test_every_tensor_is_checked_before_the_build_writes_anything(copy, tmp_path, edit, message):
    """The last layer's tensors were read (and found wrong) only once the layers before it were lowered."""
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    weights, config = load_file(copy / "model.safetensors"), json.loads((copy / "config.json").read_text())
    edit(weights, config)
    save_file(weights, copy / "model.safetensors")
    (copy / "config.json").write_text(json.dumps(config))
    seen = []
    with pytest.raises(CheckpointError, match=message):
        build_engine(BuildConfig(copy, tmp_path / "engine", max_seq_len=64), progress=seen.append)
    assert seen == [] and not (tmp_path / "engine").exists()


def test_stored_tensors_the_config_leaves_unread_are_named(copy, tmp_path):
    """As transformers loads them (and reports them unexpected): a config.json that says fewer layers than stored,
    or no attention bias where biases are stored."""
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    weights = load_file(copy / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    save_file(weights, copy / "model.safetensors")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}))
    assert Checkpoint(copy).unused[:2] == ["model.layers.0.self_attn.q_proj.bias",
                                           "model.layers.1.input_layernorm.weight"]
    seen = []
    build_engine(BuildConfig(copy, tmp_path / "engine", max_seq_len=64), progress=seen.append)
    note = next(line for line in seen if line.startswith("note:"))
    assert note.startswith("note: 10 stored tensor(s) that config.json leaves unread") and "num_hidden_layers" in note
    assert Checkpoint(make_tiny_model("qwen3-qknorm", tmp_path / "clean")).unused == []


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_weight_that_is_not_finite_is_refused_at_build_naming_it(copy, tmp_path, value):
    """It built, and every request on the engine then failed on logits that were not finite."""
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    weights = load_file(copy / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = value
    save_file(weights, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.mlp.down_proj.weight' holds NaN or infinite "
                                              "values"):
        build_engine(BuildConfig(copy, tmp_path / "engine", max_seq_len=64))
    assert not (tmp_path / "engine").exists()
