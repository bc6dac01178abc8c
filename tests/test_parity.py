"""Logit parity with transformers through the paged cache (prefill, chunked prefill, decode, packed batches) and
through the Session's sequence graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import transformers

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import EngineError
from camshaft.runtime.batch import Chunk
from camshaft.runtime.engine import Engine
from camshaft.runtime.sequence import SequenceEngine

from tiny_models import VARIANTS, make_tiny_model

BLOCK = 4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_model(request.param, root / "hf")
    build_engine(BuildConfig(model_dir, root / "engine", max_seq_len=128, kv_block_size=BLOCK, max_num_tokens=64))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return request.param, root / "engine", reference


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


class PagedSequence:
    """A sequence whose blocks come from the pool in scrambled order, so block tables are not contiguous."""

    def __init__(self, engine: Engine, ids: list[int], rng: np.random.Generator) -> None:
        needed = -(-len(ids) // BLOCK)
        blocks = engine.pool.allocate(needed + 2)
        rng.shuffle(blocks)
        self.blocks = blocks[:needed]
        self.ids = ids
        self.done = 0

    def chunk(self, n: int) -> Chunk:
        chunk = Chunk(self.ids[self.done: self.done + n], self.done, self.blocks)
        self.done += n
        return chunk


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    scale = np.abs(expected).max()
    diff = np.abs(actual - expected).max()
    assert diff <= 1e-4 * scale, f"{what}: max abs diff {diff:.3g} > 1e-4 x scale {scale:.3g}"


def test_packed_prefill_chunks_and_decode_match_transformers(variant):
    name, engine_dir, reference = variant
    engine = Engine(engine_dir, max_sequences=4)
    rng = np.random.default_rng(0)
    vocab = engine.manifest.model.vocab_size
    lengths = {"a": 45, "b": 12, "c": 22}
    ids = {k: rng.integers(3, vocab, n).tolist() for k, n in lengths.items()}
    seqs = {k: PagedSequence(engine, v, rng) for k, v in ids.items()}
    expected = {k: reference_logits(reference, v) for k, v in ids.items()}
    schedule = [
        {"a": 40, "b": 3},            # a whole prefill beside the first chunk of b
        {"a": 1, "b": 6, "c": 9},     # a decodes while b and c prefill
        {"a": 1, "b": 1, "c": 12},    # two decodes and a prefill chunk
        {"a": 1, "b": 1, "c": 1},
        {"a": 1, "b": 1},
        {"a": 1},
    ]
    checked = 0
    for step in schedule:
        names = list(step)
        chunks = [seqs[k].chunk(n) for k, n in step.items()]
        logits = engine.step(chunks)
        assert logits.shape == (len(chunks), vocab)
        for row, key in enumerate(names):
            pos = seqs[key].done - 1
            assert_close(logits[row], expected[key][pos], f"{name} seq {key} position {pos}")
            checked += 1
    assert checked == 14


def test_logits_only_for_requested_rows(variant):
    name, engine_dir, reference = variant
    engine = Engine(engine_dir, max_sequences=2)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, engine.manifest.model.vocab_size, 10).tolist()
    seq = PagedSequence(engine, ids, rng)
    first = seq.chunk(6)
    no_logits = Chunk(first.token_ids, first.start_pos, first.block_table, num_logits=0)
    assert engine.step([no_logits]).shape[0] == 0
    logits = engine.step([seq.chunk(4)])
    assert_close(logits[0], reference_logits(reference, ids)[9], f"{name} after a logits-free chunk")


def test_long_decodes_share_the_free_prefill_group(variant):
    """A decode-only step with one long and several short contexts: the long one is attended in the (otherwise
    empty) prefill group as a one-token query, so the short ones are not padded to its length; logits unchanged."""
    name, engine_dir, reference = variant
    engine = Engine(engine_dir, max_sequences=4)
    rng = np.random.default_rng(2)
    vocab = engine.manifest.model.vocab_size
    ids = {k: rng.integers(3, vocab, n).tolist() for k, n in {"long": 61, "a": 7, "b": 9, "c": 10}.items()}
    seqs = {k: PagedSequence(engine, v, rng) for k, v in ids.items()}
    for key, seq in seqs.items():
        engine.step([seq.chunk(len(ids[key]) - 1)])
    chunks = [seqs[k].chunk(1) for k in ids]
    feeds = engine.prepare(chunks).feeds
    assert feeds["decode_token_index"].shape == (3,) and feeds["prefill_token_index"].shape == (1, 1)
    assert feeds["decode_block_tables"].shape[1] < feeds["prefill_block_tables"].shape[1]
    logits = engine.step(chunks)
    for row, key in enumerate(ids):
        assert_close(logits[row], reference_logits(reference, ids[key])[-1], f"{name} seq {key}")


def test_onnxruntime_graph_skips_an_empty_group(variant):
    """Each attention group of the onnxruntime graph sits in an If on its has_<group> input; the runtime raises the
    flag only for a group with sequences (the steps above check the logits of every kind of step)."""
    _, engine_dir, _ = variant
    engine = Engine(engine_dir, max_sequences=2)
    assert {"has_decode", "has_prefill"} <= {spec.name for spec in engine.manifest.inputs}
    graph = onnx.load(engine_dir / engine.manifest.artifact, load_external_data=False).graph
    assert sum(node.op_type == "If" for node in graph.node) == 2 * engine.manifest.model.num_layers
    seq = PagedSequence(engine, list(range(3, 12)), np.random.default_rng(3))
    prefill = engine.prepare([seq.chunk(8)]).feeds
    decode = engine.prepare([seq.chunk(1)]).feeds
    assert (bool(prefill["has_decode"]), bool(prefill["has_prefill"])) == (False, True)
    assert (bool(decode["has_decode"]), bool(decode["has_prefill"])) == (True, False)


def test_onnxruntime_decode_attention_runs_one_head_per_kv_head(variant):
    """The onnxruntime graph's decode attention takes the query heads sharing a K/V head as rows of that head (the
    logit checks above cover its numbers); prefill attention keeps one head per query head."""
    _, engine_dir, _ = variant
    manifest = Engine(engine_dir, max_sequences=1).manifest
    graph = onnx.load(engine_dir / manifest.artifact, load_external_data=False).graph
    heads = {}
    for node in graph.node:
        if node.op_type == "If":
            then = next(a.g for a in node.attribute if a.name == "then_branch")
            attention = next(n for n in then.node if n.op_type == "Attention")
            attrs = {a.name: a.i for a in attention.attribute if a.name.endswith("num_heads")}
            heads.setdefault(node.input[0], set()).add((attrs["q_num_heads"], attrs["kv_num_heads"]))
    m = manifest.model
    grouped = m.num_kv_heads if m.num_heads > m.num_kv_heads else m.num_heads
    assert heads == {"has_decode": {(grouped, m.num_kv_heads)}, "has_prefill": {(m.num_heads, m.num_kv_heads)}}


def test_sequence_graph_matches_transformers(variant):
    """The Session's single-sequence graph (contiguous cache, GroupQueryAttention): a first prefill chunk, a later
    chunk over a non-empty cache, then decodes; every variant has one (head size 24 takes the unfused rotary)."""
    name, engine_dir, reference = variant
    engine = SequenceEngine(engine_dir)
    graph = onnx.load(engine_dir / engine.layout.artifact, load_external_data=False).graph
    assert sum(node.op_type == "GroupQueryAttention" for node in graph.node) == engine.manifest.model.num_layers
    ids = np.random.default_rng(4).integers(3, engine.manifest.model.vocab_size, 50).tolist()
    expected = reference_logits(reference, ids)
    engine.start(len(ids))
    fed = 0
    for n in (20, 25, 1, 1, 1, 1, 1):
        logits = engine.feed(ids[fed: fed + n], fed)
        fed += n
        assert_close(logits, expected[fed - 1], f"{name} sequence graph position {fed - 1}")
    with pytest.raises(EngineError, match="holds 50 tokens; cannot continue it at 3"):
        engine.feed([5], 3)
    with pytest.raises(EngineError, match="exceed the 128 this sequence was started for"):  # max_seq_len caps it
        engine.feed(ids * 2, 50)
    engine.close()
