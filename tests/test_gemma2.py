"""Gemma 2 (Gemma2ForCausalLM): Gemma 3's layers (test_gemma3.py) with the attention scores and the logits softcapped,
every second layer sliding and one rope; numerics of every graph also in test_parity.py's variant "gemma2", whose
caps are low enough to bite. TensorRT's attention has no softcap: its targets refuse Gemma 2 before any work."""

from __future__ import annotations

import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import BuildConfigError
from camshaft.model_config import ModelConfig
from camshaft.runtime.session import Session

from tiny_models import check_generation, tiny_engine

# gemma-2-2b-it's config.json as published, shrunk
PUBLISHED = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
             "final_logit_softcapping": 30.0, "head_dim": 32, "hidden_act": "gelu_pytorch_tanh",
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 96,
             "max_position_embeddings": 8192, "num_attention_heads": 4, "num_hidden_layers": 4,
             "num_key_value_heads": 2, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "sliding_window": 4096, "vocab_size": 384, "cache_implementation": "hybrid", "bos_token_id": 2,
             "eos_token_id": [1, 107]}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    return root / "hf", tiny_engine(root, "gemma2", max_seq_len=96, kv_block_size=4, max_num_tokens=16)


def test_gemma2_generates_what_transformers_does(gemma):
    model, engine = gemma
    check_generation(engine, model, [list(range(5, 30)), [7, 8, 9]], 24)
    with Session(engine) as session:  # the float head's greedy shortcut leaves rows at -inf: no softcap keeps that
        assert not session.engine.layout.screens_greedy
    from camshaft.runtime.engine_info import engine_info, info_lines

    assert "attention softcap 2, logit softcap 3" in "\n".join(info_lines(engine_info(engine)))


def test_a_published_config_reads_as_transformers_reads_it():
    import transformers

    ours, theirs = ModelConfig.from_hf(PUBLISHED), transformers.Gemma2Config(**PUBLISHED)
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    assert ours.layer_types == tuple(names[t] for t in theirs.layer_types) == ("sliding", "full") * 2
    assert (ours.attn_softcap, ours.logit_softcap, ours.query_scale) == (50.0, 30.0, 32 ** -0.5)
    assert (ours.local_rope, ours.qk_norm, ours.rope.theta, ours.eos_token_ids) == (None, False, 1e4, (1, 107))
    defaults = {k: v for k, v in PUBLISHED.items() if not k.endswith("softcapping")}
    assert (ModelConfig.from_hf(defaults).attn_softcap, ModelConfig.from_hf(defaults).logit_softcap) == (50.0, 30.0)
    uncapped = ModelConfig.from_hf(PUBLISHED | {"attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (uncapped.attn_softcap, uncapped.logit_softcap) == (None, None)  # null: none, as transformers reads it


def test_tensorrt_targets_refuse_gemma2_before_any_work(gemma, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    seen = []
    with pytest.raises(BuildConfigError, match="caps its attention scores .* build it for --target onnxruntime"):
        build_engine(BuildConfig(gemma[0], tmp_path / "engine", target="tensorrt-rtx", max_seq_len=64),
                     progress=seen.append)
    assert seen == [] and not (tmp_path / "engine").exists()
    import sys

    from camshaft import cli

    monkeypatched = sys.argv
    sys.argv = ["camshaft", "build", "--model", str(gemma[0]), "--output", str(tmp_path / "engine"), "--target",
                "tensorrt-rtx", "--max-seq-len", "64", "--quant", "fp8"]  # refused before calibrating, not after
    try:
        with pytest.raises(SystemExit) as stopped:
            cli.main()
    finally:
        sys.argv = monkeypatched
    assert stopped.value.code == 1 and sorted(p.name for p in tmp_path.iterdir()) == []
