"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention, a mixture of experts for the MLP (ONNX Runtime's MoE
operator: softmax routing, top-k, SwiGLU experts); numerics of both graphs also in test_parity.py's variant
"qwen3-moe" (one dense layer among the sparse ones). What it cannot take is refused before any work."""

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


def test_qwen3_moe_generates_what_transformers_does(tmp_path):
    engine = tiny_engine(tmp_path, "qwen3-moe", max_seq_len=96, kv_block_size=4, max_num_tokens=16)
    check_generation(engine, tmp_path / "hf", [list(range(5, 30)), [7, 8, 9]], 20)
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
