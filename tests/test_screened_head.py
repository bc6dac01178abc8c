"""A float head's greedy shortcut on the sequence graph (builder/graph/screen.py): certified steps give the float
head's best rows (its logits, −inf elsewhere: the same argmax); an uncertain step, or one whose logits are read
(sampling, log-probs, penalties), gets the whole float head."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.builder.graph.screen import screened_rows
from camshaft.manifest import read_manifest
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.sequence import SequenceEngine
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model

PROMPT = [5, 9, 17, 33, 41, 7]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def engine_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("screen")
    model = make_tiny_model("llama", root / "hf", tie_word_embeddings=request.param)
    build_engine(BuildConfig(model, root / "engine", max_seq_len=128))
    return root / "engine"


def logits(engine: SequenceEngine, greedy: bool, tokens: list[int] = PROMPT, rows: int = 1) -> np.ndarray:
    engine.start(len(tokens))
    engine.screen(greedy)
    try:
        return engine.feed_rows(tokens, 0, rows).copy()
    finally:
        engine.finish()


def test_a_certified_greedy_step_gives_the_float_heads_best_rows(engine_dir):
    engine = SequenceEngine(engine_dir)
    assert read_manifest(engine_dir).sequence_graph.screens_greedy
    k = screened_rows(engine.manifest.model.vocab_size)
    full = logits(engine, greedy=False)
    assert np.isfinite(full).all()
    for rows in (1, 3):  # a token and its drafts (prompt lookup): each row screened
        screened, whole = logits(engine, True, rows=rows), logits(engine, False, rows=rows)
        kept = np.isfinite(screened)
        assert (kept.sum(axis=1) == k).all() and np.isneginf(screened[~kept]).all()
        assert (screened.argmax(axis=1) == whole.argmax(axis=1)).all()
        assert np.abs(screened[kept] - whole[kept]).max() <= 1e-5 * np.abs(whole).max()
        assert all(whole[r][kept[r]].max() == whole[r].max() for r in range(rows))  # no row left out is better
    engine.close()


def test_the_screen_multiplies_uint8_by_uint8():
    """uint8 x int8 products sum pairs in int16 with saturation on x86 CPUs without VNNI (ONNX Runtime's AVX2
    kernel): the bound would not hold there. uint8 x uint8 (zero points 128) is exact everywhere."""
    from onnx import TensorProto

    from camshaft.builder.graph.ops import GraphWriter
    from camshaft.builder.graph.screen import screened_logits

    head = np.random.default_rng(0).standard_normal((256, 32)).astype(np.float32)
    with open(os.devnull, "wb") as data:
        g = GraphWriter(data, "screen.data")
        screened_logits(g, "x", head, lambda ids: g.op("Identity", [ids]), "greedy", lambda: g.op("Identity", ["x"]))
    codes = next(t for t in g.initializers if t.name == "lm_head.screen_codes")
    assert codes.data_type == TensorProto.UINT8
    nodes = [n for top in g.nodes for attr in top.attribute if attr.g.node for n in attr.g.node]
    (product,) = [n for n in nodes if n.op_type == "MatMulInteger"]
    assert product.input[1] == codes.name and len(product.input) == 4  # both zero points given


def test_session_outputs_are_the_float_heads_whatever_reads_the_logits(engine_dir):
    """Greedy with nothing reading the logits takes the shortcut; log-probs, penalties, min_tokens' ban and sampling
    read every logit, so they get the whole head: the same tokens and log-probs either way."""
    with Session(engine_dir) as session:
        engine = session.engine
        greedy = session.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
        screens = []
        real = engine.screen
        engine.screen = lambda on: screens.append(on) or real(on)
        with_logprobs = session.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2))
        assert screens and not any(screens)
        screens.clear()
        session.generate(PROMPT, SamplingParams(max_tokens=6, min_tokens=3))  # the ban on the end id, then none
        assert screens[:3] == [False] * 3 and screens[-1] is True
        screens.clear()
        session.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.8, seed=1))
        assert screens and not any(screens)
        real(False)
        engine.screen = lambda on: None  # the whole head throughout
        reference = session.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2))
    assert greedy.token_ids == with_logprobs.token_ids == reference.token_ids
    assert [s.logprob for s in with_logprobs.logprobs] == [s.logprob for s in reference.logprobs]
    assert all(s.logprob < 0 for s in with_logprobs.logprobs)


def test_an_uncertain_step_runs_the_whole_head(tmp_path):
    """A head whose rows tie: no row can be proved the best from the int8 screen, so the float head runs."""
    model = make_tiny_model("llama", tmp_path / "hf", tie_word_embeddings=False)
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    head = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = np.broadcast_to(head[:1], head.shape).copy()
    tensors["lm_head.weight"][-1] *= 1 + 1e-6  # one row above the rest by less than the screen can tell
    save_file(tensors, weights)
    config = json.loads((model / "config.json").read_text())
    assert not config.get("tie_word_embeddings")
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=128))
    engine = SequenceEngine(tmp_path / "engine")
    screened, whole = logits(engine, True), logits(engine, False)
    assert np.isfinite(screened).all() and screened.argmax() == whole.argmax() == head.shape[0] - 1
    assert np.allclose(screened, whole, rtol=1e-5, atol=0)
    engine.close()
