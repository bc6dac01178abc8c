"""config.json is read strictly: wrong types and nonsense values are one CheckpointError naming the field (never
coerced: bool("false") is True), and attention windows are read as transformers reads them."""

from __future__ import annotations

import json

import pytest
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from camshaft.errors import CamshaftError, CheckpointError, UnsupportedModelError
from camshaft.model_config import ModelConfig

from tiny_models import BASE, VARIANTS, make_tiny_model


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: json.loads((make_tiny_model(arch, root / arch) / "config.json").read_text())
            for arch in ("llama", "mistral-sliding", "qwen2-bias", "qwen3-qknorm")}


def edited(config: dict, **changes) -> dict:
    out = dict(config)
    for key, value in changes.items():
        if value is ...:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("changes, message", [
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (dict(hidden_size=64.9), "hidden_size must be an integer"),
    (dict(hidden_size=None), "lacks required field 'hidden_size'"),
    (dict(num_hidden_layers="2"), "num_hidden_layers must be an integer"),
    (dict(eos_token_id="2"), "eos_token_id must be a token id"),
    (dict(bos_token_id=-1), "bos_token_id must be a token id"),
    (dict(rms_norm_eps="x"), "rms_norm_eps must be a finite number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -5.0}), "rope_theta must be a finite number >= 0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}), "must be > 0"),
    (dict(rope_parameters=..., rope_theta=0), "must be > 0"),
    (dict(rope_scaling=[1, 2]), "rope_scaling must be an object"),
    (dict(rope_parameters=..., rope_scaling={"rope_type": "linear", "factor": 0}), "must be > 0"),
    (dict(rope_parameters=..., rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                             "high_freq_factor": 1.0}), "low_freq_factor < high_freq_factor"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling={"rope_type": "linear",
                                                                                     "factor": 2.0}),
     "different types"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
          rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}),
     "rope_parameters and rope_scaling that differ; transformers reads only rope_scaling"),
    (dict(rope_parameters=..., rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}),
     "beta_fast must be a finite number >= 0"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1}), "yarn rope needs rope_theta > 1"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "attention_factor": 0}),
     "yarn's attention factor .* must be between 1e-6 and 1e6, got 0"),
    (dict(architectures="LlamaForCausalLM"), "architectures must be a list"),
    (dict(rope_parameters=..., rope_scaling={"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 32}), "factor"),
    (dict(rope_parameters=..., rope_scaling={"rope_type": "linear"}), "factor"),
    (dict(rope_parameters=..., rope_scaling={"rope_type": "llama3", "factor": 8.0}),  # transformers refuses it too
     "lacks required field 'low_freq_factor'"),
    (dict(rope_parameters=..., rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
     "lacks required field 'high_freq_factor'"),
    (dict(max_position_embeddings=10**30), "max_position_embeddings must be an integer >= 2 and <= 2147483647"),
    (dict(max_position_embeddings=1), "max_position_embeddings must be an integer >= 2"),
    (dict(hidden_size=66, head_dim=...), "hidden_size 66 is not a multiple of num_attention_heads 4, and no head_dim "
     "is given"),
])
def test_bad_values_are_one_clear_error(configs, changes, message):
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf(edited(configs["llama"], **changes))


def test_an_integer_epsilon_is_read_as_the_float_it_means(configs):
    """An ONNX epsilon attribute is a float: an integer (0 for 0.0) failed the build after every layer was written."""
    eps = ModelConfig.from_hf(edited(configs["llama"], rms_norm_eps=0)).rms_norm_eps
    assert eps == 0.0 and type(eps) is float


def test_good_variants_read_as_transformers_does(configs):
    llama = ModelConfig.from_hf(edited(configs["llama"], sliding_window=5, hidden_size=float(
        configs["llama"]["hidden_size"]), rms_norm_eps=None))
    assert llama.sliding_window is None and set(llama.layer_types) == {"full"}  # Llama has no window
    assert llama.rms_norm_eps == 1e-6 and isinstance(llama.hidden_size, int)
    mistral = configs["mistral-sliding"]
    assert ModelConfig.from_hf(edited(mistral, sliding_window=...)).sliding_window == 4096  # MistralConfig's
    assert ModelConfig.from_hf(edited(mistral, sliding_window=None)).sliding_window is None
    assert ModelConfig.from_hf(edited(mistral, sliding_window=7)).layer_types == ("sliding",) * mistral[
        "num_hidden_layers"]
    qwen = ModelConfig.from_hf(edited(configs["qwen2-bias"], use_sliding_window=False, sliding_window=7))
    assert qwen.sliding_window is None
    scaled = ModelConfig.from_hf(edited(configs["llama"], rope_parameters=..., rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}))
    assert scaled.rope.type == "llama3" and scaled.rope.original_max_position_embeddings == 64
    assert scaled.rope.theta == 5e5  # the old style: rope_theta beside rope_scaling


@pytest.mark.parametrize("scaling, top", [
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, {}),  # Qwen2.5's long-context recipe
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
     {"original_max_position_embeddings": 32}),  # at the top level too: transformers takes that one
    ({"type": "yarn", "factor": 4.0}, {"max_position_embeddings": ...}),  # both from Qwen2Config's default (32768)
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, "mscale": 0.707,
      "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}, {}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 1.5,
      "truncate": 0}, {}),  # transformers tests truncate's truth
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128}, {}),  # null: 512 / 128
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
     {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                          "rope_theta": 1e4}}),  # both sections, agreeing (an old config.json merged with a new)
])
def test_yarn_frequencies_and_scale_are_transformers(configs, scaling, top):
    import numpy as np
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from camshaft.builder.graph.rope import cos_sin_tables, inverse_frequencies

    hf = edited(configs["qwen2-bias"], **{"rope_parameters": ..., "rope_theta": 1e4, "rope_scaling": scaling, **top})
    ours = ModelConfig.from_hf(hf)
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](transformers.Qwen2Config(**hf))
    assert np.array_equal(inverse_frequencies(ours.rope, ours.head_dim), inv_freq.numpy())
    assert ours.rope.attention_factor == pytest.approx(scale, rel=1e-12)
    with pytest.raises(CheckpointError, match="longrope's short_factor must be a list of positive numbers, not None"):
        ModelConfig.from_hf(edited(hf, rope_parameters=..., rope_scaling={"rope_type": "longrope", "factor": 2.0}))
    with pytest.raises(UnsupportedModelError, match="rope scaling 'su' is not supported .supported: default, "
                                                    "dynamic, linear, llama3, yarn, longrope"):  # Phi-3 alone reads su
        ModelConfig.from_hf(edited(hf, rope_parameters=..., rope_scaling={"rope_type": "su", "factor": 2.0}))
    if top.get("max_position_embeddings", 0) is ...:
        assert ours.max_position_embeddings == 32768 == ours.rope.original_max_position_embeddings
    tiny_factor = ModelConfig.from_hf(edited(hf, rope_parameters=..., rope_scaling={**scaling, "factor": 1e-50}))
    with pytest.raises(CheckpointError, match="rotary tables that are not finite"):  # NaN, as transformers computes
        cos_sin_tables(tiny_factor.rope, ours.head_dim, 8)
    with pytest.raises(CheckpointError, match="lacks required field 'factor'"):  # as transformers refuses it
        ModelConfig.from_hf(edited(hf, rope_parameters=..., rope_scaling={"rope_type": "yarn",
                                                                          "original_max_position_embeddings": 64}))


@pytest.mark.parametrize("changes", [{}, {"sliding_window": 64}, {"max_window_layers": 1}, {"sliding_window": None}])
def test_qwen_windows_default_as_transformers_does(configs, changes):
    """use_sliding_window with keys left out: transformers' defaults (window 4096 from layer 28 on) apply."""
    hf = edited(configs["qwen2-bias"], **{"layer_types": ..., "sliding_window": ..., "max_window_layers": ...,
                                          "use_sliding_window": True, "num_hidden_layers": 30, **changes})
    reference = transformers.Qwen2Config(**hf)
    ours = ModelConfig.from_hf(hf)
    assert ours.sliding_window == reference.sliding_window
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    assert ours.layer_types == tuple(names[t] for t in reference.layer_types)


def test_dynamic_rope_is_transformers_within_the_models_context(configs):
    """Dynamic NTK scaling changes the frequencies only past max_position_embeddings, which a build cannot reach:
    older Llama fine-tunes that carry it build (they were refused)."""
    import numpy as np
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from camshaft.builder.graph.rope import inverse_frequencies

    hf = edited(configs["llama"], rope_parameters=..., rope_theta=1e4, max_position_embeddings=64,
                rope_scaling={"type": "dynamic", "factor": 4.0})
    ours = ModelConfig.from_hf(hf)
    inv_freq, scale = ROPE_INIT_FUNCTIONS["dynamic"](transformers.LlamaConfig(**hf))
    assert np.array_equal(inverse_frequencies(ours.rope, ours.head_dim), inv_freq.numpy()) and scale == 1.0
    assert ours.rope.type == "dynamic" and ours.context_length == 64


@pytest.mark.parametrize("where", ["top", "rope"])
def test_partial_rotary_is_refused_not_built_whole(configs, where):
    hf = edited(configs["llama"], rope_parameters=..., rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                                     **({"partial_rotary_factor": 0.5}
                                                                        if where == "rope" else {})})
    hf = edited(hf, partial_rotary_factor=0.5) if where == "top" else hf
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.5 .rotary embedding over part of each "
                                                    "head. is not supported for llama: only Phi-3's"):
        ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf(edited(hf, partial_rotary_factor=1.0) if where == "top" else edited(
        hf, rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 1})).rope.type == "linear"


@pytest.mark.parametrize("name, config_class", [("llama", transformers.LlamaConfig),
                                                ("mistral-sliding", transformers.MistralConfig),
                                                ("qwen2-bias", transformers.Qwen2Config),
                                                ("qwen3-qknorm", transformers.Qwen3Config)])
def test_kv_heads_default_as_transformers_does(configs, name, config_class):
    """Without num_key_value_heads Mistral has 8 and Qwen 32 (their config defaults), not one per head: such a
    checkpoint's k_proj was refused as a wrong shape."""
    for heads in (32, 64):
        hf = edited(configs[name], num_attention_heads=heads, hidden_size=heads * 4, head_dim=4,
                    num_key_value_heads=...)
        assert ModelConfig.from_hf(hf).num_kv_heads == config_class(**hf).num_key_value_heads
    if name != "llama":
        with pytest.raises(CheckpointError, match="has no num_key_value_heads, so transformers takes .* which does "
                                                  "not divide num_attention_heads=12"):
            ModelConfig.from_hf(edited(configs[name], num_attention_heads=12, hidden_size=48, head_dim=4,
                                       num_key_value_heads=...))
    null = edited(configs[name], num_attention_heads=16, hidden_size=64, head_dim=4, num_key_value_heads=None)
    assert ModelConfig.from_hf(null).num_kv_heads == 16


def test_head_dim_defaults_as_transformers_does(configs):
    for name, config_class in (("qwen3-qknorm", transformers.Qwen3Config), ("llama", transformers.LlamaConfig)):
        hf = edited(configs[name], head_dim=...)
        assert ModelConfig.from_hf(hf).head_dim == config_class(**hf).head_dim
    odd = edited(configs["qwen2-bias"], hidden_size=130, head_dim=...)  # Qwen2 rounds down; only Llama refuses it
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**odd))
    assert ModelConfig.from_hf(odd).head_dim == model.model.layers[0].self_attn.head_dim == 32
    with pytest.raises(Exception, match=r"hidden size \(66\) is not a multiple of the number of attention heads"):
        transformers.LlamaConfig(**edited(configs["llama"], hidden_size=66, head_dim=...))


def test_a_number_past_any_float_is_a_clear_error(configs):
    with pytest.raises(CheckpointError, match="rms_norm_eps must be a finite number"):
        ModelConfig.from_hf(edited(configs["llama"], rms_norm_eps=10**400))


def test_an_unsupported_class_is_not_rescued_by_model_type(configs):
    with pytest.raises(UnsupportedModelError, match="LlamaForSequenceClassification"):
        ModelConfig.from_hf(edited(configs["llama"], architectures=["LlamaForSequenceClassification"]))
    assert ModelConfig.from_hf(edited(configs["llama"], architectures=...)).architecture == "llama"
    with pytest.raises(CamshaftError):
        ModelConfig.from_hf(edited(configs["llama"], architectures=..., model_type="bert"))


@pytest.mark.parametrize("name, arch, model_type", [("qwen2-bias", "LlamaForCausalLM", "qwen2"),
                                                     ("llama", "Qwen2ForCausalLM", "llama"),
                                                     ("llama", "LlamaForCausalLM", "gemma")])
def test_a_class_that_disagrees_with_model_type_is_refused(configs, name, arch, model_type):
    """transformers builds what model_type names: a llama engine of a qwen2 model would drop its q/k/v biases."""
    with pytest.raises(CheckpointError, match=f"names {arch} but model_type '{model_type}'"):
        ModelConfig.from_hf(edited(configs[name], architectures=[arch], model_type=model_type))


@pytest.mark.parametrize("arch, qkv, o, mlp", [("llama", True, True, True), ("qwen3-qknorm", True, True, False),
                                               ("qwen2-bias", True, False, False), ("mistral-sliding", False, False,
                                                                                    False)])
def test_biases_follow_each_architecture_as_transformers_builds_it(configs, tmp_path, arch, qkv, o, mlp):
    config = ModelConfig.from_hf(edited(configs[arch], attention_bias=True, mlp_bias=True))
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (qkv, o, mlp)
    model = make_tiny_model(arch, tmp_path / "m", attention_bias=True, mlp_bias=True)  # transformers: its own biases
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert ("model.layers.0.self_attn.o_proj.bias" in names) == o
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == qkv
    assert ("model.layers.0.mlp.down_proj.bias" in names) == mlp


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": None, "rope_theta": 1e4}, rope_scaling={"rope_type": "linear", "factor": 2}),
     "rope_parameters's rope_type must be a string"),
    (dict(rope_scaling={"rope_type": ["default"]}), "rope_scaling's rope_type must be a string"),
    (dict(architectures=[], model_type=["llama"]), "not supported"),
])
def test_odd_json_types_are_a_clear_error_not_a_traceback(configs, changes, message):
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf(edited(configs["llama"], **changes))


def test_rope_scaling_extends_the_context_a_build_may_ask_for(configs):
    """vLLM's rule: yarn holds original_max_position_embeddings x factor, linear max_position_embeddings x factor
    (Qwen2.5's long-context recipe leaves max_position_embeddings at the native length)."""
    from camshaft.builder.config import BuildConfig
    from camshaft.errors import BuildConfigError

    yarn = ModelConfig.from_hf(edited(configs["llama"], max_position_embeddings=64, rope_parameters=...,
                                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 64}))
    linear = ModelConfig.from_hf(edited(configs["llama"], max_position_embeddings=64, rope_parameters=...,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0}))
    plain = ModelConfig.from_hf(edited(configs["llama"], max_position_embeddings=64))
    assert (yarn.context_length, linear.context_length, plain.context_length) == (256, 128, 64)
    assert BuildConfig("m", "e", max_seq_len=256).resolved_max_seq_len(yarn) == 256
    assert BuildConfig("m", "e").resolved_max_seq_len(yarn) == 256
    with pytest.raises(BuildConfigError, match=r"exceeds the model's context \(256 tokens: max_position_embeddings "
                                               r"64, yarn rope scaling x4 included\); pass --max-seq-len 256"):
        BuildConfig("m", "e", max_seq_len=300).resolved_max_seq_len(yarn)
    with pytest.raises(BuildConfigError, match=r"\(64 tokens: max_position_embeddings 64\); pass"):
        BuildConfig("m", "e", max_seq_len=65).resolved_max_seq_len(plain)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rope_theta_left_out_defaults_as_transformers_does(name):
    """Mixtral's default is 1e6 and SmolLM3's 2e6, not 10000 (a config without the key built a model whose rotary
    tables were not transformers')."""
    config_cls, extra = VARIANTS[name]
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    hf = config.to_dict() | {"architectures": [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]}
    hf.pop("rope_theta", None)
    sections = [hf["rope_parameters"]] if "rope_type" in hf["rope_parameters"] else [*hf["rope_parameters"].values()]
    for section in sections:
        section.pop("rope_theta")
    if all(set(s) == {"rope_type"} and s["rope_type"] == "default" for s in sections):
        hf.pop("rope_parameters")  # as an old config.json without any rope key
    expected = getattr(transformers, config_cls)(**hf).rope_parameters
    ours = ModelConfig.from_hf(hf)
    if "rope_type" in expected:
        assert ours.rope.theta == expected["rope_theta"]
    else:  # Gemma 3: per kind of layer
        assert (ours.rope.theta, ours.local_rope.theta) == (expected["full_attention"]["rope_theta"],
                                                            expected["sliding_attention"]["rope_theta"])
