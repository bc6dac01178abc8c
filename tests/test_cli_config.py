"""`camshaft --config FILE`: a TOML table per command sets its options, the flags typed win, and a file that names
anything the CLI does not have is refused before the command runs; every preset in configs/ reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer.main
from test_cli import camshaft

from camshaft.cli import app
from camshaft.cli.config_file import read_defaults

from tiny_models import tiny_engine

PRESETS = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return tiny_engine(tmp_path_factory.mktemp("cli_config"), max_seq_len=64, max_num_tokens=16, kv_block_size=8)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_a_file_sets_a_commands_options_and_the_flags_typed_win(engine, capsys, tmp_path):
    model = engine.parent / "hf"
    config = write(tmp_path / "c.toml", f'[build]\nmodel = "{model}"\nmax-seq-len = 48\nkv-block-size = 8\n'
                                        "max-num-tokens = 24\n")
    out = tmp_path / "engine"
    code, _, err = camshaft(capsys, "--config", config, "build", "--output", out, "--max-seq-len", "32")
    assert code == 0, err
    limits = json.loads((out / "manifest.json").read_text())["limits"]
    assert (limits["max_seq_len"], limits["kv_block_size"], limits["max_num_tokens"]) == (32, 8, 24)


def test_an_error_naming_a_flag_the_file_set_says_where_it_was_set(engine, capsys, tmp_path, monkeypatch):
    """Review: "add --chat (or drop --system)" for a system message the --config file set, with nothing pointing at
    the file; the table of the command run is named, and a flag typed on the command line is not attributed."""
    config = write(tmp_path / "c.toml", '[run]\nsystem = "be brief"\n[build]\nmax-batch-size = 2\n')
    code, _, err = camshaft(capsys, "--config", config, "run", "--engine", engine, "--prompt", "hi")
    assert code == 1 and f"drop --system) (--system is set by {config} [run])" in " ".join(err.split()), err
    code, _, err = camshaft(capsys, f"--config={config}", "run", "--engine", engine, "--prompt", "hi")
    assert code == 1 and f"(--system is set by {config} [run])" in " ".join(err.split()), err
    code, _, err = camshaft(capsys, "--config", config, "run", "--engine", engine, "--prompt", "hi", "--system", "x")
    assert code == 1 and "is set by" not in err, err
    keyed = write(tmp_path / "k.toml", '[serve]\napi-key = "good"\napi = "openai"\n')  # re-review: the
    monkeypatch.setenv("CAMSHAFT_API_KEY", " bad ")  # environment's key wins over the file's: not the file's
    code, _, err = camshaft(capsys, "--config", keyed, "serve", "--engine", engine)
    assert code == 1 and "--api-key is empty" in err and "is set by" not in err, err
    monkeypatch.setenv("CAMSHAFT_API_KEY", "")  # empty: click takes the file's value, so the note names it
    code, _, err = camshaft(capsys, "--config", write(tmp_path / "k2.toml", '[serve]\napi-key = " "\n'
                                                      'api = "openai"\n'), "serve", "--engine", engine)
    assert code == 1 and "(--api-key is set by" in " ".join(err.split()), err
    monkeypatch.delenv("CAMSHAFT_API_KEY")
    code, _, err = camshaft(capsys, "--config", keyed, "--config", config, "run", "--engine", engine,
                            "--prompt", "hi")  # the last --config is the one applied
    assert code == 1 and f"(--system is set by {config} [run])" in " ".join(err.split()), err
    fetch = write(tmp_path / "f.toml", '[models.fetch]\noutput = "/proc/nope"\n')  # NAME is no subcommand
    code, _, err = camshaft(capsys, "--config", fetch, "models", "fetch", "smollm2-135m-instruct")
    assert code == 1 and f"(--output is set by {fetch} [models.fetch])" in " ".join(err.split()), err
    bench = write(tmp_path / "b.toml", '[bench.throughput]\ndataset = "nope.jsonl"\n')
    code, _, err = camshaft(capsys, "--config", bench, "bench", "throughput", "--engine", engine)
    assert code == 1 and "is set by" not in err, err  # the message names no flag


def test_a_subcommands_table_and_a_list_option(engine, capsys, tmp_path):
    result = tmp_path / "latency.json"
    config = write(tmp_path / "c.toml", f'[bench.latency]\nrepeats = 2\nprompt-len = 16\nmax-tokens = 3\n'
                                        f'output-json = "{result}"\n[build]\nexclude = "model.layers.0.*"\n')
    assert read_defaults(config, typer.main.get_command(app))["build"]["exclude"] == ["model.layers.0.*"]
    code, _, err = camshaft(capsys, "--config", config, "bench", "latency", "--engine", engine)
    assert code == 0, err
    report = json.loads(result.read_text())
    assert (report["repeats"], report["prompt_tokens"], report["output_tokens"]) == (2, 16, 3), report


@pytest.mark.parametrize(("text", "said"), [
    ("[biuld]\nmax-seq-len = 48\n", "[biuld] names no camshaft command; its sections are the commands: bench, build"),
    ("[build]\nmax_seq_len = 48\n", "[build] has 'max_seq_len', not an option of `camshaft build`; did you mean "
                                    "max-seq-len?"),
    ("[bench.throughput]\nconcurency = 4\n", "did you mean concurrency?"),
    ("[bench.fast]\nrepeats = 4\n", "[bench.fast] names no camshaft subcommand of `camshaft bench`"),
    ("[build]\nmax-seq-len = \"long\"\n", "[build] max-seq-len = 'long': Invalid value for '--max-seq-len'"),
    ("build = 48\n", "build must be a table ([build])"),
    ("[build\n", "is not valid TOML"),
    ("[build]\nversion = true\n", "'version', not an option of `camshaft build`"),
    ("[build]\nmax-batch-size = true\n", "max-batch-size = True: takes a string or a number, not bool"),
    ("[build]\nquant = [\"int4_awq\"]\n", "takes one value, not a list"),  # not the text "['int4_awq']"
    ("[build]\nexclude = [[\"a\"]]\n", "takes strings or numbers, not list"),
    ("[build]\ntarget = { name = \"onnxruntime\" }\n", "takes a string or a number, not dict"),
    ("[build]\nmodel = 1979-05-27\n", "not date"),
    ("[run]\nstream = 1\n", "a flag takes true or false"),
])
def test_a_file_naming_what_the_cli_has_not_is_refused_before_the_command_runs(engine, capsys, tmp_path, text,
                                                                                said):
    model = engine.parent / "hf"
    out = tmp_path / "engine"
    code, _, err = camshaft(capsys, "--config", write(tmp_path / "c.toml", text), "build", "--model", model,
                            "--output", out)
    assert code == 1 and said in " ".join(err.split()), err
    assert "Traceback" not in err and not out.exists()


def test_a_byte_order_mark_and_a_home_directory_read_as_an_editor_and_the_shell_give_them(engine, capsys, tmp_path):
    config = write(tmp_path / "c.toml", "\ufeff[inspect]\njson = true\n[build]\noutput = \"~/engine\"\n")
    code, out, err = camshaft(capsys, "--config", config, "inspect", "--engine", engine)
    assert code == 0 and json.loads(out)["engine"] == str(engine), err
    assert read_defaults(config, typer.main.get_command(app))["build"]["output"] == str(Path.home() / "engine")


def test_a_missing_file_is_named(capsys, tmp_path):
    code, _, err = camshaft(capsys, "--config", tmp_path / "none.toml", "inspect", "--engine", tmp_path)
    assert code != 0 and "none.toml" in err and "Traceback" not in err


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_reads_against_the_cli(preset):
    defaults = read_defaults(preset, typer.main.get_command(app))
    assert defaults and all(defaults.values()), defaults


def test_there_are_presets():
    assert {p.name for p in PRESETS} >= {"cpu-int4.toml", "cpu-batch32.toml"}
