"""OLMo 2 (Olmo2ForCausalLM): Llama's layers with their norms moved after the attention and the MLP (no input norms)
and q/k norms over all heads at once; numerics of every graph also in test_parity.py's variant "olmo2"."""

from __future__ import annotations

from camshaft.model_config import ModelConfig

from tiny_models import check_generation, tiny_engine

# OLMo-2-0425-1B's config.json as published, shrunk
PUBLISHED = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
             "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 4096,
             "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
             "rope_theta": 500000, "tie_word_embeddings": False, "vocab_size": 384}


def test_a_published_config_reads_as_olmo2():
    c = ModelConfig.from_hf(PUBLISHED)
    assert (c.pre_norms, c.sandwich_norms, c.qk_norm, c.qk_norm_per_head) == (False, True, True, False)
    assert (c.rms_norm_eps, c.rope.theta, c.norm_offset, c.tie_word_embeddings) == (1e-6, 5e5, 0.0, False)
    assert ModelConfig.from_hf({k: v for k, v in PUBLISHED.items() if k != "rms_norm_eps"}).rms_norm_eps == 1e-5
    # Olmo2's attention has no window, whatever config.json says (found by a review)
    assert ModelConfig.from_hf(PUBLISHED | {"use_sliding_window": True, "sliding_window": 5}).sliding_window is None


def test_olmo2_generates_what_transformers_does(tmp_path):
    engine = tiny_engine(tmp_path, "olmo2", max_seq_len=96, kv_block_size=4, max_num_tokens=16)
    check_generation(engine, tmp_path / "hf", [list(range(5, 30)), [7, 8, 9]], 20)
