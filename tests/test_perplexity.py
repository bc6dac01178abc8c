"""`camshaft eval ppl`: engine perplexity equals transformers' on the same windows; bad input is one clear error."""

from __future__ import annotations

import re

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


def independent_perplexity(model_dir, text: str, window: int) -> tuple[float, int]:
    """transformers' own loss over non-overlapping windows, none of camshaft's windowing or log-softmax."""
    import math

    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer(text)["input_ids"]
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), window):
            part = torch.tensor([ids[start:start + window]])
            if part.shape[1] < 2:
                continue
            loss = reference(part, labels=part).loss  # mean over the window's shifted targets
            total, count = total + float(loss) * (part.shape[1] - 1), count + part.shape[1] - 1
    return math.exp(total / count), count


def test_engine_perplexity_equals_transformers(tiny):
    model, engine = tiny
    heard: list[str] = []  # long work shows progress: each window as it is scored
    ours = engine_perplexity(engine, TEXT, progress=heard.append)
    theirs = reference_perplexity(model, TEXT, window=128, progress=heard.append)
    assert ours.windows == theirs.windows > 1  # the text spans several windows, each in several chunks
    assert heard == [f"{name}: window {i}/{ours.windows}" for name in ("engine", "transformers")
                     for i in range(1, ours.windows + 1)]
    assert ours.tokens_scored == theirs.tokens_scored
    expected, scored = independent_perplexity(model, TEXT, 128)  # the shared scoring code checked too
    assert ours.tokens_scored == scored
    for result in (ours, theirs):
        assert abs(result.perplexity - expected) / expected < 1e-4, (result.perplexity, expected)


def test_the_cli_scores_engine_and_reference_on_the_same_windows(tiny, tmp_path, capsys):
    model, engine = tiny
    (tmp_path / "text.txt").write_text(TEXT)
    text = tmp_path / "text.txt"
    code, out, _ = camshaft(capsys, "eval", "ppl", "--engine", engine, "--model", model, "--data", text)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2, out
    engine_ppl, reference_ppl = (float(line.split()[2]) for line in lines)
    assert abs(engine_ppl - reference_ppl) / reference_ppl < 1e-4 and lines[0].split("(")[1] == lines[1].split("(")[1]
    expected = independent_perplexity(model, TEXT, 128)[0]  # the engine's max_seq_len: both scored its windows
    assert abs(engine_ppl - expected) / expected < 1e-3  # as printed, to 4 decimals
    assert re.search(r"tokens, \d+ windows? of \d+ tokens\)$", lines[0]), lines[0]  # the window size shown
    code, _, err = camshaft(capsys, "eval", "ppl", "--engine", engine, "--model", model, "--data",
                            tmp_path / "text.txt", "--window", "64")
    assert code == 0 and "not of the same windows" in err


def test_bad_input(tiny, tmp_path, capsys):
    _, engine = tiny
    with pytest.raises(RequestError, match="does not exist"):
        read_text(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    code, _, err = camshaft(capsys, "eval", "ppl", "--engine", engine, "--data", tmp_path / "empty.txt")
    assert code == 1 and "is empty" in err and "Traceback" not in err


def refuse_loading(monkeypatch):
    """Fails the test if transformers loads anything: the errors below must come first."""
    import transformers

    def refuse(*_a, **_k):
        raise AssertionError("transformers loaded a model or tokenizer before the input was checked")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


@pytest.fixture
def no_model_load(monkeypatch):
    refuse_loading(monkeypatch)


def quantized_checkpoint(model, out):
    pytest.importorskip("modelopt.torch.quantization")
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    return quantize_checkpoint(model, out, QuantSpec("int8_wo"), calib_size=2, calib_seq_len=32).output


@pytest.mark.parametrize("case", ["missing", "engine", "quantized", "no-config", "window 0", "window 1",
                                  "window long", "another model"])
def test_bad_reference_input_is_one_clear_error_before_loading(tiny, tmp_path, capsys, monkeypatch, case):
    model, engine = tiny
    (tmp_path / "t.txt").write_text(TEXT)
    args, expected = {
        "missing": (["--model", tmp_path / "nonexist"], "nonexist is not a directory; pass a Hugging Face checkpoint"),
        "engine": (["--model", engine], "is an engine directory; pass it with --engine"),
        "quantized": (["--model", tmp_path / "q"], "is a quantized checkpoint (hf_quant_config.json), which "
                      "transformers does not run as camshaft builds it; build an engine"),
        "no-config": (["--model", tmp_path], "has no config.json"),
        "window 0": (["--model", model, "--window", "0"], "Invalid value for '--window'"),  # typer's range: x>=2
        "window 1": (["--engine", engine, "--model", model, "--window", "1"], "Invalid value for '--window'"),
        "window long": (["--model", model, "--window", "513"], "--window 513 exceeds --model's "
                        "max_position_embeddings (512); pass --window 512 or less"),
        "another model": (["--engine", engine, "--model", tmp_path / "other"], "other is not the model the --engine "
                          "was built from (architecture qwen2 vs llama, intermediate_size 96 vs 64)"),
    }[case]
    if case == "quantized":
        quantized_checkpoint(model, tmp_path / "q")
    if case == "another model":
        make_tiny_model("llama", tmp_path / "other", intermediate_size=64)
    capsys.readouterr()
    refuse_loading(monkeypatch)
    code, out, err = camshaft(capsys, "eval", "ppl", "--data", tmp_path / "t.txt", *args)
    err = " ".join(err.split())
    if case in ("window 0", "window 1"):  # a usage error, as a value outside a flag's stated range is
        assert code == 2 and out == "" and expected in err and "Traceback" not in err, err
        return
    assert code == 1 and out == "" and err.startswith("error: ") and expected in err, err
    assert "Traceback" not in err and err.count("error:") == 1


def broken_copy(model, out, case: str):
    """A copy of the tiny checkpoint broken the way `case` says."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(model, out)
    weights = out / "model.safetensors"
    if case == "missing tensor":
        tensors = load_file(weights)
        save_file({k: v for k, v in tensors.items() if k != "model.layers.0.mlp.down_proj.weight"}, weights)
    elif case == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif case == "unsupported architecture":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    elif case == "pickle weights":
        weights.rename(out / "pytorch_model.bin")
    elif case == "integer epsilon":  # camshaft builds it; transformers' Llama config refuses it
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 0}))
    elif case == "not finite":
        tensors = load_file(weights)
        tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = float("inf")
        save_file(tensors, weights)
    return out


@pytest.mark.parametrize("case, expected", [
    ("missing tensor", "lacks model.layers.0.mlp.down_proj.weight; transformers would score random weights"),
    ("truncated weights", "broken/model.safetensors is not a readable safetensors file"),
    ("unsupported architecture", "architecture ['GPT2LMHeadModel'] is not supported"),
    ("pickle weights", "holds only pickle weights"),
    ("integer epsilon", "transformers cannot read its config.json"),
    ("not finite", "tensor 'model.layers.0.mlp.up_proj.weight' holds NaN or infinite values"),
])
def test_a_broken_reference_checkpoint_is_refused_not_scored(tiny, tmp_path, capsys, case, expected):
    """transformers fills a missing tensor with random values (and only logs it), and loads pickles: the reference
    takes only what camshaft build would."""
    model, _ = tiny
    broken = broken_copy(model, tmp_path / "broken", case)
    (tmp_path / "t.txt").write_text(TEXT)
    code, out, err = camshaft(capsys, "eval", "ppl", "--data", tmp_path / "t.txt", "--model", broken)
    err = " ".join(err.split())
    assert code == 1 and "ppl" not in out and expected in err, err
    assert "Traceback" not in err


def test_the_engine_result_is_printed_before_the_reference_runs(tiny, tmp_path, capsys):
    """The engine pass can take minutes on a long text: a reference that then fails keeps its printed result."""
    model, engine = tiny
    broken = broken_copy(model, tmp_path / "broken", "missing tensor")
    (tmp_path / "t.txt").write_text(TEXT)
    code, out, err = camshaft(capsys, "eval", "ppl", "--data", tmp_path / "t.txt", "--engine", engine,
                              "--model", broken)
    assert code == 1 and out.startswith("engine       ppl ") and "lacks model.layers.0" in " ".join(err.split())


def test_a_byte_order_mark_is_not_scored(tiny, tmp_path):
    _, engine = tiny
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + TEXT.encode())
    assert read_text(tmp_path / "bom.txt") == TEXT
    assert engine_perplexity(engine, read_text(tmp_path / "bom.txt")) == engine_perplexity(engine, TEXT)


def test_line_endings_are_scored_as_the_file_has_them(tmp_path):
    """A Windows text's \r\n are its tokens too (llama.cpp's perplexity reads the bytes so); reading it in Python's
    text mode scored the text with \n alone."""
    crlf = "line one\r\nline two\rline three\r\n"
    (tmp_path / "crlf.txt").write_bytes(crlf.encode())
    assert read_text(tmp_path / "crlf.txt") == crlf


def test_reference_perplexity_checks_its_inputs_first(tiny, tmp_path, no_model_load):
    _, engine = tiny
    with pytest.raises(RequestError, match="is an engine directory"):
        reference_perplexity(engine, TEXT, window=128)
    with pytest.raises(RequestError, match="--window must be at least 2"):
        reference_perplexity(engine, TEXT, window=1)


def test_cli_prints_both(tiny, tmp_path, capsys):
    model, engine = tiny
    (tmp_path / "t.txt").write_text(TEXT)
    code, out, _ = camshaft(capsys, "eval", "ppl", "--engine", engine, "--model", model, "--data", tmp_path / "t.txt",
                            "--window", "128")
    assert code == 0
    values = [float(line.split()[2]) for line in out.strip().splitlines()]
    assert len(values) == 2 and abs(values[0] - values[1]) / values[1] < 1e-4


def test_the_reference_window_defaults_to_what_the_model_holds(tiny, tmp_path):
    from camshaft.runtime.perplexity import REFERENCE_WINDOW, reference_window

    model, _ = tiny
    assert reference_window(model, None) == min(REFERENCE_WINDOW, 512) == 512  # tiny models hold 512 positions
    assert reference_window(model, 100) == 100
    (tmp_path / "config.json").write_text("{}")
    assert reference_window(tmp_path, None) == REFERENCE_WINDOW


def test_a_token_outside_the_models_vocabulary_is_refused(tiny, tmp_path):
    """A tokenizer with tokens past the model's vocabulary (the build allows it; prompts holding them are refused):
    a text holding one is refused on both sides, not sent to a Gather out of bounds."""
    import shutil

    import transformers

    model, _ = tiny
    extra = tmp_path / "hf"
    shutil.copytree(model, extra)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(extra))
    tokenizer.add_tokens([f"<x{i}>" for i in range(200)])  # past the tiny model's 384
    tokenizer.save_pretrained(str(extra))
    engine = tmp_path / "engine"
    build_engine(BuildConfig(extra, engine, max_seq_len=64, max_num_tokens=32, kv_block_size=16))
    text = "hello <x199> world"
    assert max(tokenizer(text)["input_ids"]) >= 384
    with pytest.raises(RequestError, match="outside the engine's vocabulary"):
        engine_perplexity(engine, text)
    with pytest.raises(RequestError, match="outside --model's vocabulary"):
        reference_perplexity(extra, text, 64)
