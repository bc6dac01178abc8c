"""Mixtures of experts — Qwen3-MoE, Mixtral, OLMoE — lowered to ONNX Runtime's MoE operator (softmax routing, top-k,
SwiGLU experts); numerics of both graphs also in test_parity.py's variants "qwen3-moe" (one dense layer among the
sparse ones), "mixtral-moe" (a sliding window), "olmoe" (weights not renormalized) and "granitemoe" (the experts
stacked in one tensor, Granite's multipliers). What they cannot take is
refused before any work."""

from __future__ import annotations

import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import BuildConfigError, UnsupportedModelError
from camshaft.manifest import read_manifest
from camshaft.model_config import ModelConfig
from camshaft.runtime.flops import linear_params

from tiny_models import check_generation, tiny_engine

# Qwen3-30B-A3B's config.json as published, shrunk
PUBLISHED = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
             "intermediate_size": 96, "moe_intermediate_size": 16, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4, "num_experts": 8,
             "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "vocab_size": 384, "rope_theta": 1e6, "tie_word_embeddings": False}


@pytest.mark.parametrize(("changes", "moe_layers"), [({}, (0, 1, 2, 3)), ({"mlp_only_layers": [0, 2]}, (1, 3)),
                                                     ({"decoder_sparse_step": 2}, (1, 3)),
                                                     ({"num_local_experts": 8, "num_experts": None}, (0, 1, 2, 3))])
def test_a_published_config_reads_its_experts(changes, moe_layers):
    c = ModelConfig.from_hf({k: v for k, v in (PUBLISHED | changes).items() if v is not None})
    assert (c.num_experts, c.experts_per_token, c.expert_intermediate_size) == (8, 2, 16)
    assert c.normalize_expert_weights and c.moe_layers == moe_layers and c.qk_norm


MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
           "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None, "rope_theta": 1e6,
           "vocab_size": 384}
OLMOE = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 64, "intermediate_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "num_experts": 16,
         "num_experts_per_tok": 4, "norm_topk_prob": False, "clip_qkv": None, "vocab_size": 384}


def test_mixtral_olmoe_and_granitemoe_configs_read_their_experts():
    mixtral, olmoe = ModelConfig.from_hf(MIXTRAL), ModelConfig.from_hf(OLMOE)
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (8, 2, 96)
    assert mixtral.normalize_expert_weights and mixtral.moe_layers == (0, 1) and mixtral.sliding_window is None
    assert (olmoe.num_experts, olmoe.experts_per_token, olmoe.normalize_expert_weights) == (16, 4, False)
    assert (olmoe.qk_norm, olmoe.qk_norm_per_head, olmoe.rms_norm_eps) == (True, False, 1e-5)
    with pytest.raises(UnsupportedModelError, match="clip_qkv=8.0 is not supported"):
        ModelConfig.from_hf(OLMOE | {"clip_qkv": 8.0})
    granite = ModelConfig.from_hf(MIXTRAL | {"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe",
                                             "embedding_multiplier": 12.0, "logits_scaling": 6.0})
    assert (granite.num_experts, granite.normalize_expert_weights, granite.embed_scale, granite.logits_divisor) == (
        8, True, 12.0, 6.0)  # softmax over the chosen experts' logits: Mixtral's renormalized top-k


def test_config_keys_transformers_reads_otherwise_are_read_as_it_does():
    """Either expert-count key (transformers maps each to the other); layer_types, which MixtralConfig and
    Qwen3MoeConfig do not have: their models slide every layer by sliding_window (found by a review)."""
    assert ModelConfig.from_hf({k: v for k, v in OLMOE.items() if k != "num_experts"} | {"num_local_experts": 16}
                               ).num_experts == 16
    assert ModelConfig.from_hf({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"} | {"num_experts": 4}
                               ).num_experts == 4
    listed = {"sliding_window": 5, "layer_types": ["full_attention", "sliding_attention"]}
    assert ModelConfig.from_hf(MIXTRAL | listed).layer_types == ("sliding", "sliding")
    assert ModelConfig.from_hf(PUBLISHED | listed | {"use_sliding_window": True, "num_hidden_layers": 2}
                               ).layer_types == ("sliding", "sliding")
    assert ModelConfig.from_hf(OLMOE | {"use_sliding_window": True, "sliding_window": 5}).sliding_window is None
    # a Mistral config listing layer_types loads as Ministral (AutoConfig), whose layers follow it
    mistral = MIXTRAL | {"architectures": ["MistralForCausalLM"], "model_type": "mistral"} | listed
    assert ModelConfig.from_hf(mistral).layer_types == ("full", "sliding")
    granite = MIXTRAL | {"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", "num_experts": 4}
    assert ModelConfig.from_hf(granite).num_experts == 8  # GraniteMoeConfig reads num_local_experts only


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral-moe", "olmoe", "granitemoe"])
def test_a_mixture_of_experts_generates_what_transformers_does(tmp_path, variant):
    engine = tiny_engine(tmp_path, variant, max_seq_len=96, kv_block_size=4, max_num_tokens=16)
    check_generation(engine, tmp_path / "hf", [list(range(5, 30)), [7, 8, 9]], 20)
    if variant != "qwen3-moe":
        return
    m = read_manifest(engine).model  # the throughput benchmark's FLOPs count the experts a token is routed to
    attention = 64 * (64 + 2 * 32) + 64 * 64  # q, k, v, o of hidden 64, 4 heads / 2 KV heads of 16
    routed = 64 * 4 + 2 * 3 * 64 * 32  # the router, and 2 experts of 32 a token
    assert (m.moe_layers, linear_params(read_manifest(engine))[0]) == ((0,), 2 * attention + 3 * 64 * 96 + routed)


def test_what_a_mixture_of_experts_cannot_take_is_refused_before_any_work(tmp_path):
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    from tiny_models import make_tiny_model

    model = make_tiny_model("qwen3-moe", tmp_path / "hf")
    with pytest.raises(UnsupportedModelError, match="quantizing a mixture of experts is not supported yet"):
        quantize_checkpoint(model, tmp_path / "q", QuantSpec("fp8"))
    if pytest.importorskip("tensorrt_rtx"):
        with pytest.raises(BuildConfigError, match="ONNX Runtime's MoE operator, which TensorRT does not take"):
            build_engine(BuildConfig(model, tmp_path / "engine", target="tensorrt-rtx", max_seq_len=64))
