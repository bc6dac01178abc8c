"""SmolLM3 (SmolLM3ForCausalLM): Llama's layers, every no_rope_layer_interval-th without rope (NoPE), sliding where
use_sliding_window says so (its NoPE layers); numerics of every graph also in test_parity.py's variant
"smollm3-nope"."""

from __future__ import annotations

import json

import pytest

from camshaft.errors import CheckpointError
from camshaft.model_config import ModelConfig
from camshaft.runtime.session import Session

from tiny_models import greedy_under_transformers, make_tiny_model

# SmolLM3-3B's config.json as published, shrunk
PUBLISHED = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 64,
             "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 8,
             "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0], "rope_theta": 5e6,
             "max_position_embeddings": 65536, "use_sliding_window": False, "sliding_window": None,
             "vocab_size": 384, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("changes", [{}, {"no_rope_layers": None}, {"use_sliding_window": True, "sliding_window": 8}])
def test_a_published_config_reads_as_transformers_reads_it(changes):
    import transformers

    hf = PUBLISHED | changes
    ours, theirs = ModelConfig.from_hf(hf), transformers.SmolLM3Config(**hf)
    assert ours.layers_without_rope == tuple(i for i, rope in enumerate(theirs.no_rope_layers) if not rope) == (3, 7)
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    assert ours.layer_types == tuple(names[t] for t in theirs.layer_types)
    assert ours.sliding_window == (8 if changes.get("use_sliding_window") else None)


def test_listed_sliding_layers_slide_whatever_use_sliding_window_says():
    """SmolLM3Model builds their sliding mask from sliding_window (its eager and sdpa attention follow it)."""
    listed = PUBLISHED | {"layer_types": ["full_attention", "sliding_attention"] * 4, "sliding_window": 8}
    assert ModelConfig.from_hf(listed).layer_types == ("full", "sliding") * 4
    with pytest.raises(CheckpointError, match="lists sliding_attention layers but sliding_window is null"):
        ModelConfig.from_hf(listed | {"sliding_window": None})


def test_no_rope_layers_of_the_wrong_length_are_refused():
    with pytest.raises(CheckpointError, match="no_rope_layers must list 0 or 1 for each of the 8 layers"):
        ModelConfig.from_hf(PUBLISHED | {"no_rope_layers": [1, 0, 1]})


@pytest.mark.parametrize("window", [None, 6])
def test_nope_layers_generate_what_transformers_does(tmp_path, window):
    """With use_sliding_window the NoPE layers attend to the last `window` positions, the rotating ones to all."""
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    model = make_tiny_model("smollm3-nope", tmp_path / "hf")
    if window:
        hf = json.loads((model / "config.json").read_text())
        hf.pop("layer_types")  # as the published configs: derived from no_rope_layers
        (model / "config.json").write_text(json.dumps(hf | {"use_sliding_window": True, "sliding_window": window}))
        assert ModelConfig.from_hf_dir(model).layer_types == ("full", "sliding") * 2
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=96, kv_block_size=4, max_num_tokens=16))
    from camshaft.runtime.engine_info import engine_info, info_lines

    assert "layers [1, 3] without rope" in "\n".join(info_lines(engine_info(tmp_path / "engine")))
    prompt = list(range(5, 30))
    for graph in ("sequence", "batch"):
        with Session(tmp_path / "engine", graph=graph) as session:
            got = session.generate(prompt, max_tokens=20, ignore_eos=True).token_ids
        assert greedy_under_transformers(model, prompt, got), graph
