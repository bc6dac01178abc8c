"""`camshaft eval ppl`: engine perplexity equals transformers' on the same windows; bad input is one clear error."""

from __future__ import annotations

import pytest
from test_cli import camshaft

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import RequestError
from camshaft.runtime.perplexity import engine_perplexity, read_text, reference_perplexity

from tiny_models import make_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    model = make_tiny_model("qwen2-bias", root / "hf")
    engine = root / "engine"
    build_engine(BuildConfig(model, engine, max_seq_len=128, max_num_tokens=48, kv_block_size=16))
    return model, engine


def test_engine_perplexity_equals_transformers(tiny):
    model, engine = tiny
    ours = engine_perplexity(engine, TEXT)
    theirs = reference_perplexity(model, TEXT, window=128)
    assert ours.windows == theirs.windows > 1  # the text spans several windows, each in several chunks
    assert ours.tokens_scored == theirs.tokens_scored
    assert abs(ours.perplexity - theirs.perplexity) / theirs.perplexity < 1e-4


def test_bad_input(tiny, tmp_path, capsys):
    _, engine = tiny
    with pytest.raises(RequestError, match="does not exist"):
        read_text(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    code, _, err = camshaft(capsys, "eval", "ppl", "--engine", engine, "--data", tmp_path / "empty.txt")
    assert code == 1 and "is empty" in err and "Traceback" not in err


def test_cli_prints_both(tiny, tmp_path, capsys):
    model, engine = tiny
    (tmp_path / "t.txt").write_text(TEXT)
    code, out, _ = camshaft(capsys, "eval", "ppl", "--engine", engine, "--model", model, "--data", tmp_path / "t.txt",
                            "--window", "128")
    assert code == 0
    values = [float(line.split()[2]) for line in out.strip().splitlines()]
    assert len(values) == 2 and abs(values[0] - values[1]) / values[1] < 1e-4
