"""LongRoPE (Phi-3-mini-128k, Phi-3.5-mini): short factors within the original context, long ones past it. A request
that may grow past it (prompt + max_tokens) rotates with the long factors throughout, as transformers rotates a
forward pass that long; one that stays within it, with the short ones. (transformers' generate starts a sequence on
the short factors and recomputes its cache with the long ones when it crosses: the same from there on.) The tiny
model's original context is 32 positions (parity of single forward passes: test_parity.py's "phi3-longrope")."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from camshaft import LLM, SamplingParams
from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CheckpointError, EngineError, UnsupportedModelError
from camshaft.model_config import ModelConfig
from camshaft.runtime.batch import Chunk, build_step
from camshaft.runtime.engine import Engine
from camshaft.runtime.engine_info import engine_info, info_lines
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model, stamped

ORIGINAL = 32
PROMPTS = {  # prompt, max_tokens
    "crossing": (list(range(5, 25)), 40),  # 20 + 40 > 32: long factors throughout
    "long prompt": ([7 + (i * 37) % 370 for i in range(40)], 20),  # the prompt alone is past 32
    "within": (list(range(40, 50)), 12),  # 10 + 12 <= 32: short factors throughout
    "to the edge": (list(range(60, 80)), 13),  # 20 + 13: the last token is never fed, so passes stop at 32: short
}
ROOMY = dict(max_seq_len=96, kv_block_size=4, max_num_tokens=16)  # prompts prefill in chunks of 16


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    root = tmp_path_factory.mktemp("longrope")
    model = make_tiny_model("phi3-longrope", root / "hf")
    build_engine(BuildConfig(model, root / "engine", **ROOMY))
    return model, root / "engine"


def transformers_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


def check_greedy(model, prompt: list[int], new: int, got: list[int]) -> None:
    """`got` is greedy under transformers' one forward pass over the whole sequence (whose length picks the factors
    as the request's prompt + max_tokens does here), and where transformers' generate keeps to one set of factors
    from the start (a long prompt, or a sequence that stays within the original context), it is its output too."""
    import torch

    assert len(got) == new
    with torch.no_grad():
        whole = torch.tensor([prompt + got[:-1]])
        logits = model(whole).logits[0, len(prompt) - 1:]
        assert logits.argmax(-1).tolist() == got
        if len(prompt) > ORIGINAL or len(prompt) + new - 1 <= ORIGINAL:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
            assert out[0, len(prompt):].tolist() == got


@pytest.mark.parametrize("graph", ["sequence", "batch"])
def test_a_session_rotates_as_transformers_does(longrope, graph):
    model_dir, engine = longrope
    model = transformers_model(model_dir)
    with Session(engine, graph=graph) as session:
        for prompt, new in PROMPTS.values():
            got = session.generate(prompt, max_tokens=new, ignore_eos=True).token_ids
            check_greedy(model, prompt, new, got)


def test_in_flight_batching_rotates_each_sequence_by_its_own_length(longrope):
    """Requests on either set of factors in the same steps: each token's table rows follow its own request."""
    model_dir, engine = longrope
    prompts, news = zip(*PROMPTS.values(), strict=True)
    with LLM(engine) as llm:
        outputs = llm.generate(list(prompts), [SamplingParams(max_tokens=n, ignore_eos=True) for n in news],
                               use_tqdm=False)
        assert llm.executor.peak_batch_size == len(PROMPTS)
    model = transformers_model(model_dir)
    for output, prompt, new in zip(outputs, prompts, news, strict=True):
        check_greedy(model, prompt, new, output.outputs[0].token_ids)


def test_prefix_reuse_keeps_short_and_long_rotated_blocks_apart(longrope):
    """The cache holds rotated keys: a prompt's blocks computed on the short factors are no prefix for a request on
    the long ones (nor the other way), while requests on the same factors share them."""
    model_dir, engine = longrope
    prompt = list(range(100, 124))  # 24 tokens: 6 full blocks of 4, the last token always computed
    model = transformers_model(model_dir)
    with LLM(engine) as llm:
        blocks = llm.executor.scheduler.blocks
        for new, shared in ((4, 0), (20, 0), (16, 5), (6, 5)):  # 28 tokens: short; 44 and 40: long; 30: short again
            hits = blocks.prefix_hits
            got = llm.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True), use_tqdm=False)
            assert blocks.prefix_hits - hits == shared, new
            check_greedy(model, prompt, new, got[0].outputs[0].token_ids)


def test_the_step_feeds_each_tokens_first_long_position(longrope):
    rope = ModelConfig.from_hf_dir(longrope[0]).rope
    chunks = [Chunk([1, 2, 3], 0, [1], longest_pass=33),  # passes past 32: long from position 0
              Chunk([4], 20, [2] * 6, longest_pass=32),  # stays within: short (long from 32, never reached)
              Chunk([5, 6], 30, [3] * 8)]  # none said: the chunk ends a forward pass of 32 tokens
    feeds = build_step(chunks, 4, None, long_rope=rope).feeds
    assert feeds["long_rope_from"].tolist() == [0, 0, 0, ORIGINAL, ORIGINAL, ORIGINAL]
    assert "long_rope_from" not in build_step(chunks, 4, None).feeds


def test_an_engine_within_the_original_context_builds_without_the_long_rows(longrope, tmp_path):
    model, _ = longrope
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=ORIGINAL, kv_block_size=4, max_num_tokens=16))
    engine = Engine(tmp_path / "engine")
    assert "long_rope_from" not in {spec.name for spec in engine.manifest.inputs}
    graph = onnx.load(tmp_path / "engine" / engine.manifest.artifact, load_external_data=False).graph
    rows = {init.name: init.dims[0] for init in graph.initializer if init.name in ("rope_cos", "rope_sin")}
    assert rows == {"rope_cos": ORIGINAL, "rope_sin": ORIGINAL}
    prompt, new = PROMPTS["within"]
    info = engine_info(tmp_path / "engine")
    assert (info["model"]["rope"]["long_factors_past"], engine_info(longrope[1])["model"]["rope"]["long_factors_past"]
            ) == (None, ORIGINAL)
    assert "rope longrope x16 (short factors only: max_seq_len is within the original context)" in "\n".join(
        info_lines(info))
    assert "rope longrope x16 (long factors for requests whose prompt + max_tokens - 1 exceeds 32)" in "\n".join(
        info_lines(engine_info(longrope[1])))
    with Session(tmp_path / "engine") as session:
        check_greedy(transformers_model(model), prompt, new, session.generate(prompt, max_tokens=new,
                                                                              ignore_eos=True).token_ids)


@pytest.mark.parametrize("loader", [Engine, Session])
def test_a_manifest_edited_against_the_long_rows_is_refused(longrope, tmp_path, loader):
    copy = tmp_path / "engine"
    shutil.copytree(longrope[1], copy)
    raw = json.loads((copy / "manifest.json").read_text())
    raw["model"]["rope"]["original_max_position_embeddings"] = 4096  # the long factors would never be reached
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match="LongRoPE's long factors.*rebuild the engine"):
        loader(copy)


def phi3_config(model_dir, **changes) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters")
    return config | changes


@pytest.mark.parametrize("long", [False, True])
def test_the_rotary_tables_are_transformers(longrope, long):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from camshaft.builder.graph.rope import inverse_frequencies

    config = json.loads((longrope[0] / "config.json").read_text())
    ours = ModelConfig.from_hf(config)
    inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](transformers.Phi3Config(**config),
                                                      seq_len=ORIGINAL + 1 if long else None)
    assert np.array_equal(inverse_frequencies(ours.rope, ours.head_dim, long), inv_freq.numpy())
    assert ours.rope.attention_factor == pytest.approx(scale, rel=1e-12)


@pytest.mark.parametrize("kind", ["longrope", "su", "yarn"])
def test_phi3_reads_su_and_yarn_as_longrope_with_its_attention_factor(longrope, kind):
    """As Phi3Config: the 128k models' config.json says "su" or "longrope" in rope_scaling; factor = 512 / 32."""
    factors = dict(short_factor=[1.0] * 8, long_factor=[4.0] * 8)
    rope = ModelConfig.from_hf(phi3_config(longrope[0], rope_scaling={"type": kind, **factors})).rope
    assert (rope.type, rope.original_max_position_embeddings, rope.long_factor) == ("longrope", ORIGINAL, (4.0,) * 8)
    assert rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(512 / 32) / np.log(32)))
    without = phi3_config(longrope[0], rope_scaling={"type": kind, **factors})
    del without["original_max_position_embeddings"]  # Phi3Config's 4096
    assert ModelConfig.from_hf(without).rope.original_max_position_embeddings == 4096


@pytest.mark.parametrize(("rope_scaling", "error", "message"), [
    ({"type": "longrope", "short_factor": [1.0] * 8}, CheckpointError, "longrope's long_factor must be a list"),
    ({"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7}, CheckpointError,
     "short_factor and long_factor: lists of the same length"),
    ({"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [2.0] * 7}, CheckpointError,
     r"one entry per rotary frequency \(rotary dimensions / 2 = 8\), got 7"),
    ({"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7 + [-1]}, CheckpointError,
     "longrope's long_factor must be a list of positive numbers"),
    ({"type": "linear", "factor": 2.0}, UnsupportedModelError, r"Phi-3 rope scaling \(rope_scaling 'linear'\)"),
])
def test_malformed_longrope_settings_are_refused(longrope, rope_scaling, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf(phi3_config(longrope[0], rope_scaling=rope_scaling))
