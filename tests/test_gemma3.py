"""Gemma 3's text models (Gemma3ForCausalLM): norms that scale by 1 + weight, four a layer, a scaled embedding, GELU
(tanh), queries scaled by query_pre_attn_scalar, sliding layers on their own rope; numerics of every graph also in
test_parity.py's variant "gemma3". What Gemma 3 may be configured for beyond that is refused, saying so."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from camshaft import LLM, SamplingParams
from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import UnsupportedModelError
from camshaft.model_config import ModelConfig
from camshaft.runtime.session import Session

from tiny_models import greedy_under_transformers, make_tiny_model, tiny_engine

# gemma-3-1b-it's config.json as published (transformers 4 style), shrunk: no layer_types, no rope_parameters
PUBLISHED = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attn_logit_softcapping": None,
             "final_logit_softcapping": None, "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh",
             "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 512, "num_attention_heads": 4,
             "num_hidden_layers": 7, "num_key_value_heads": 1, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-6,
             "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 8,
             "sliding_window_pattern": 6, "vocab_size": 384, "bos_token_id": 2, "eos_token_id": 1}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return root / "hf", tiny_engine(root, "gemma3", max_seq_len=96, kv_block_size=4, max_num_tokens=16)


@pytest.mark.parametrize("graph", ["sequence", "batch"])
def test_a_gemma3_engine_generates_what_transformers_does(gemma, graph):
    model, engine = gemma
    prompt = list(range(5, 30))
    with Session(engine, graph=graph) as session:
        assert greedy_under_transformers(model, prompt, session.generate(prompt, max_tokens=30,
                                                                         ignore_eos=True).token_ids)


def test_in_flight_batching_of_gemma3_requests(gemma):
    model, engine = gemma
    prompts = [list(range(5, 30)), list(range(100, 140)), [7, 8, 9]]
    with LLM(engine) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    for output, prompt in zip(outputs, prompts, strict=True):
        assert greedy_under_transformers(model, prompt, output.outputs[0].token_ids)


def test_a_published_config_reads_as_transformers_reads_it():
    """Layer types from sliding_window_pattern, the full layers' rope from rope_theta, the sliding layers' from
    rope_local_base_freq; the rotary tables equal transformers' for each."""
    import transformers

    from camshaft.builder.graph.rope import inverse_frequencies

    ours, theirs = ModelConfig.from_hf(PUBLISHED), transformers.Gemma3TextConfig(**PUBLISHED)
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    assert ours.layer_types == tuple(names[t] for t in theirs.layer_types) == ("sliding",) * 5 + ("full", "sliding")
    assert (ours.tie_word_embeddings, ours.qk_norm, ours.sliding_window, ours.embed_scale) == (True, True, 8, 8.0)
    assert ours.query_scale == 32 ** -0.5 and ours.activation == "gelu_tanh" and ours.norm_offset == 1.0
    rotary = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(theirs)
    for layer, kind in ((0, "sliding_attention"), (5, "full_attention")):
        rope = ours.layer_rope(layer)
        ours_freq, theirs_freq = inverse_frequencies(rope, ours.head_dim), getattr(rotary, f"{kind}_inv_freq").numpy()
        np.testing.assert_allclose(ours_freq, theirs_freq, rtol=2.5e-7, atol=0)  # numpy's float32 pow: 1 ulp at most
        assert rope.attention_factor == getattr(rotary, f"{kind}_attention_scaling"), kind
    scaled = ModelConfig.from_hf(PUBLISHED | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (scaled.rope.type, scaled.rope.factor, scaled.local_rope.type) == ("linear", 8.0, "default")  # Gemma 3 4B+
    assert scaled.context_length == 512  # max_position_embeddings already counts the scaling (vLLM reads it so)


@pytest.mark.parametrize(("changes", "message"), [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported for gemma3"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                       "original_max_position_embeddings": 64}}, "longrope on Gemma 3's full layers"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}, "is not supported; supported:"),
])
def test_what_gemma3_may_be_configured_for_beyond_that_is_refused(changes, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        ModelConfig.from_hf(PUBLISHED | changes)


@pytest.mark.parametrize(("changes", "message"), [
    ({"sliding_window": None}, "sliding_window is null, but Gemma's sliding layers need one"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 8.0}}, "needs a section per layer type"),
])
def test_a_gemma3_config_transformers_would_not_run_so_is_refused(changes, message):
    from camshaft.errors import CheckpointError

    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf(PUBLISHED | changes)


def test_inspect_names_each_kind_of_layers_rope(gemma):
    from camshaft.runtime.engine_info import engine_info, info_lines

    info = engine_info(gemma[1])
    assert info["model"]["local_rope"] == {"type": "default", "theta": 1e4, "factor": 1.0}
    assert "full layers' rope linear x2 θ 1e+06, sliding layers' default θ 10000" in "\n".join(info_lines(info))


def test_a_quantized_gemma3_engine_matches_modelopts_fake_quant_model(gemma, tmp_path):
    """int4 AWQ, as test_quantize.py's bar: the engine's logits within a tenth of the quantization's own change,
    built with float compute (the default int8 compute also rounds the activations, which Gemma's scaled embedding
    makes large: 12 % of the change on this model, as int4_wo's)."""
    import torch
    import transformers

    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec
    from camshaft.runtime.batch import Chunk
    from camshaft.runtime.engine import Engine

    pytest.importorskip("modelopt.torch.quantization")
    model = gemma[0]
    prompt = torch.randint(3, 384, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = {}

    def capture(quantized):
        with torch.no_grad():
            ref["logits"] = quantized(prompt).logits[0].numpy().copy()

    quantize_checkpoint(model, tmp_path / "q", QuantSpec("int4_awq"), on_quantized=capture, calib_size=4,
                        calib_seq_len=64)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    build_engine(BuildConfig(tmp_path / "q", tmp_path / "engine", max_seq_len=64, kv_block_size=4,
                             weight_only_compute="float"))
    engine = Engine(tmp_path / "engine", max_sequences=1)
    logits = engine.step([Chunk(prompt[0].tolist(), 0, engine.pool.allocate(12), 48)])
    with torch.no_grad():
        fp32 = transformers.AutoModelForCausalLM.from_pretrained(model).eval()(prompt).logits[0].numpy()
    assert np.abs(ref["logits"] - fp32).max() > 1e-3  # the quantization is real
    assert np.abs(logits - ref["logits"]).max() <= 0.1 * np.abs(ref["logits"] - fp32).max()


def test_an_attention_softcap_in_a_gemma3_config_is_ignored_as_transformers_ignores_it(tmp_path):
    """Review: Gemma3Attention keeps attn_logit_softcapping but never applies it (Gemma 2's does); the engine capped
    the scores and disagreed with transformers (the final logits' cap stays, as transformers applies it)."""
    assert ModelConfig.from_hf(PUBLISHED | {"attn_logit_softcapping": 5.0}).attn_softcap is None
    model = make_tiny_model("gemma3", tmp_path / "hf", attn_logit_softcapping=5.0, final_logit_softcapping=30.0)
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64, kv_block_size=4, max_num_tokens=16))
    prompt = list(range(5, 45))
    with Session(tmp_path / "engine") as session:
        assert greedy_under_transformers(model, prompt, session.generate(prompt, max_tokens=12,
                                                                         ignore_eos=True).token_ids)
