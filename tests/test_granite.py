"""Granite 3 (GraniteForCausalLM): Llama's layers with multipliers on the embedding, on each sublayer's output as it
joins the residual stream, on the attention scores (in place of head_dim ** -0.5), and a divisor on the logits;
numerics of every graph also in test_parity.py's variant "granite-multipliers"."""

from __future__ import annotations

import pytest

from camshaft.errors import CheckpointError
from camshaft.model_config import ModelConfig

from tiny_models import check_generation, tiny_engine

# granite-3.1-2b-instruct's config.json as published, shrunk
PUBLISHED = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "attention_bias": False,
             "attention_multiplier": 0.015625, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
             "logits_scaling": 8.0, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 131072,
             "rope_theta": 5e6, "tie_word_embeddings": True, "vocab_size": 384, "rms_norm_eps": 1e-5}


def test_a_published_config_reads_its_multipliers():
    c = ModelConfig.from_hf(PUBLISHED)
    assert (c.embed_scale, c.residual_scale, c.query_scale, c.logits_divisor) == (12.0, 0.22, 0.015625, 8.0)
    plain = ModelConfig.from_hf({k: v for k, v in PUBLISHED.items() if not k.endswith(("multiplier", "scaling"))})
    # GraniteConfig's defaults: 1 each, the attention scores' too (not head_dim ** -0.5)
    assert (plain.embed_scale, plain.residual_scale, plain.query_scale, plain.logits_divisor) == (1, 1, 1, 1)
    with pytest.raises(CheckpointError, match="Granite's multipliers must be > 0"):
        ModelConfig.from_hf(PUBLISHED | {"logits_scaling": 0})


def test_granite_generates_what_transformers_does(tmp_path):
    engine = tiny_engine(tmp_path, "granite-multipliers", max_seq_len=96, kv_block_size=4, max_num_tokens=16)
    check_generation(engine, tmp_path / "hf", [list(range(5, 30)), [7, 8, 9]], 20)
