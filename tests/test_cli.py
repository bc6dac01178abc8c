"""The CLI end to end on a tiny model: build, run, and bad input that ends in one clear line, never a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import onnxruntime
import pytest

from camshaft import cli

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = make_tiny_model("llama", root / "hf")
    return root, model


def camshaft(capsys, *args: str) -> tuple[int, str, str]:
    argv = sys.argv
    sys.argv = ["camshaft", *map(str, args)]
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def engine(tiny):
    root, model = tiny
    out = root / "engine"
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    build_engine(BuildConfig(model, out, max_seq_len=64, max_num_tokens=16, kv_block_size=8))
    return out


def test_build_then_run(tiny, capsys):
    root, model = tiny
    out = root / "cli-engine"
    code, stdout, err = camshaft(capsys, "build", "--model", model, "--output", out, "--max-seq-len", "64")
    assert code == 0, err
    assert stdout.strip() == str(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["limits"]["max_seq_len"] == 64 and manifest["target"] == "onnxruntime"
    code, stdout, err = camshaft(capsys, "run", "--engine", out, "--prompt", "hello", "--max-tokens", "5")
    assert code == 0, err
    count, reason = re.search(r"(\d+) tokens? · finish (\w+)", err).groups()  # an early end id stops it: "stop"
    assert (int(count), reason) == (5, "length") or (int(count) < 5 and reason == "stop"), err


def test_run_streams_the_same_text_as_generate(engine, capsys):
    code, plain, stats = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc", "--max-tokens", "12")
    assert code == 0
    code, streamed, streamed_stats = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc", "--max-tokens",
                                              "12", "--stream")
    assert code == 0
    assert streamed == plain
    assert "12 tokens · finish length" in stats and "12 tokens · finish length" in streamed_stats
    code, _, one = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc", "--max-tokens", "1")
    assert code == 0 and "1 token · finish length · TTFT" in one and "tok/s" not in one  # no decode speed of 1 token


def test_run_takes_the_stop_and_penalty_a_server_request_takes(engine, capsys):
    """--stop, --repetition-penalty and --min-p give what SamplingParams with them gives (a model's recommended
    repetition_penalty could not be turned off from the command line)."""
    from camshaft.runtime.sampling_params import SamplingParams
    from camshaft.runtime.session import Session

    with Session(engine) as session:
        def expected(**sampling) -> str:
            return session.generate("abc", SamplingParams(max_tokens=12, ignore_eos=False, **sampling)).text

        plain = expected()
        stop = plain[4:6]
        cases = [(["--stop", stop, "--stop", "never there"], expected(stop=(stop, "never there"))),
                 (["--repetition-penalty", "1.8"], expected(repetition_penalty=1.8)),
                 (["--temperature", "0.9", "--min-p", "0.3", "--seed", "5"],
                  expected(temperature=0.9, min_p=0.3, seed=5))]
    assert cases[0][1] == plain[:plain.index(stop)] and cases[1][1] != plain
    for args, text in cases:
        code, out, err = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc", "--max-tokens", "12", *args)
        assert code == 0 and out == text + "\n", err


def test_run_chat_template_replaces_the_engines(engine, capsys, tmp_path):
    """--chat-template's file renders the --chat messages: one that writes the user's words alone gives the plain
    prompt's output; one that does not parse is refused, naming the file and line, before the engine loads."""
    code, plain, _ = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc def", "--max-tokens", "8")
    assert code == 0
    bare = tmp_path / "bare.jinja"
    bare.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    code, chat, _ = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc def", "--max-tokens", "8", "--chat")
    assert code == 0 and chat != plain  # the engine's own template wraps the words
    code, templated, _ = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc def", "--max-tokens", "8",
                                  "--chat", "--chat-template", bare)
    assert code == 0 and templated == plain
    roles = tmp_path / "roles.jinja"
    roles.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    code, empty_system, _ = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc def", "--max-tokens", "8",
                                     "--chat", "--chat-template", roles, "--system", "")
    code, written, _ = camshaft(capsys, "run", "--engine", engine, "--prompt", "[system][user]abc def",
                                "--max-tokens", "8")
    assert empty_system == written  # --system "": an empty system turn (not dropped for the template's default)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }")
    code, _, err = camshaft(capsys, "run", "--engine", engine, "--prompt", "hi", "--chat", "--chat-template", broken)
    assert code == 1 and f"{broken} is not a valid Jinja chat template: line 2" in err and "Traceback" not in err


def test_sampling_flags_at_temperature_zero_are_named_as_doing_nothing(engine, capsys):
    code, greedy, err = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc", "--max-tokens", "6")
    assert code == 0 and "note:" not in err
    code, same, err = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc", "--max-tokens", "6", "--top-k",
                               "5", "--seed", "3")
    assert code == 0 and same == greedy and "--top-k, --seed change nothing at --temperature 0" in err
    assert "--temperature 0 (greedy decoding); add --temperature above 0 to sample" in err  # one line in a log
    code, _, err = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc", "--top-p", "0")
    assert code == 1 and "--top-p must be in (0, 1]" in err and "note:" not in err  # refused, not called unused


def test_run_reads_the_prompt_from_stdin(engine, capsys, monkeypatch):
    import io

    code, expected, _ = camshaft(capsys, "run", "--engine", engine, "--prompt", "abc\ndef", "--max-tokens", "6")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"abc\ndef\n")))
    code, piped, _ = camshaft(capsys, "run", "--engine", engine, "--prompt", "-", "--max-tokens", "6")
    assert code == 0 and piped == expected  # the newline echo adds is not part of the prompt
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbfabc\r\ndef\r\n")))
    code, piped, _ = camshaft(capsys, "run", "--engine", engine, "--prompt", "-", "--max-tokens", "6")
    assert code == 0 and piped != expected  # a BOM is dropped, a CR inside the text kept
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbfcaf\xe9")))
    code, _, err = camshaft(capsys, "run", "--engine", engine, "--prompt", "-")
    assert code == 1 and "reads UTF-8 text from stdin; byte 6 is not UTF-8" in err  # counted from the first byte
    monkeypatch.setattr(sys, "stdin", None)  # started with stdin closed (<&-)
    code, _, err = camshaft(capsys, "run", "--engine", engine, "--prompt", "-")
    assert code == 1 and "reads the prompt from stdin, which is closed" in err


BAD_RUNS = {
    "empty prompt": (["--prompt", ""], "prompt is empty"),
    "empty chat prompt": (["--prompt", "", "--chat"], "content is empty"),
    "prompt too long": (["--prompt", "x" * 200], "allows 64 tokens"),
    "max_tokens past the engine": (["--prompt", "hi", "--max-tokens", "300"], "pass --max-tokens <= "),
    "negative temperature": (["--prompt", "hi", "--temperature", "-1"], "--temperature must be >= 0"),
    "top_p zero": (["--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    "top_p above one": (["--prompt", "hi", "--top-p", "1.5"], "--top-p"),
    "top_k below -1": (["--prompt", "hi", "--top-k", "-2"], "--top-k must be >= 1"),
    "repetition penalty zero": (["--prompt", "hi", "--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    "min_p above one": (["--prompt", "hi", "--min-p", "2"], "--min-p must be in [0, 1]"),
    "empty stop": (["--prompt", "hi", "--stop", ""], "--stop must be a non-empty string"),
    "system without chat": (["--prompt", "hi", "--system", "be brief"], "add --chat"),
    "chat template without chat": (["--prompt", "hi", "--chat-template", "t.jinja"], "add --chat"),
    "chat template missing": (["--prompt", "hi", "--chat", "--chat-template", "no/such.jinja"],
                              "is neither a file nor a template"),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_bad_run_input_is_one_clear_error(engine, capsys, case):
    args, needle = BAD_RUNS[case]
    code, _, err = camshaft(capsys, "run", "--engine", engine, *args)
    assert code == 1
    assert "error:" in err and needle in err
    assert "Traceback" not in err


def test_unknown_engine_dir(tmp_path, capsys):
    code, _, err = camshaft(capsys, "run", "--engine", tmp_path / "nope", "--prompt", "hi")
    assert code == 1 and "does not exist" in err and "Traceback" not in err


def test_unsupported_architecture_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    code, _, err = camshaft(capsys, "build", "--model", tmp_path, "--output", tmp_path / "out")
    assert code == 1 and "GPT2LMHeadModel" in err and "supported" in err


def test_pickle_only_checkpoint_is_refused(tiny, tmp_path, capsys):
    _, model = tiny
    (tmp_path / "config.json").write_text((model / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really")
    code, _, err = camshaft(capsys, "build", "--model", tmp_path, "--output", tmp_path / "out")
    assert code == 1 and "pickle" in err and "safetensors" in err


def test_corrupt_generation_config_is_named(tiny, tmp_path, capsys):
    import shutil

    _, model = tiny
    broken = tmp_path / "hf"
    shutil.copytree(model, broken)
    (broken / "generation_config.json").write_text("{")
    code, _, err = camshaft(capsys, "build", "--model", broken, "--output", tmp_path / "out")
    assert code == 1 and "generation_config.json is not valid JSON" in err and "Traceback" not in err


def test_build_quant_is_quantize_then_build_in_one_step(tiny, capsys):
    root, model = tiny
    out = root / "int8-engine"
    code, _, err = camshaft(capsys, "build", "--model", model, "--output", out, "--kv-cache-dtype", "int8")
    assert code == 1 and "add --quant" in err and not out.exists()
    code, _, err = camshaft(capsys, "build", "--model", model, "--output", out, "--target", "tensorrt-rtx",
                            "--gpu-arch", "sm89", "--quant", "int8_wo", "--kv-cache-dtype", "int8")
    assert code == 1 and "cannot build a KV cache in int8 (with --quant int8_wo): camshaft lowers" in err
    assert not (root / "int8-engine.ckpt").exists()
    code, _, err = camshaft(capsys, "build", "--model", model, "--output", out, "--target", "tensorrt-rtx",
                            "--gpu-arch", "sm86", "--quant", "fp8")
    assert code == 1 and "sm86" in err and not (root / "int8-engine.ckpt").exists()
    code, _, err = camshaft(capsys, "build", "--model", model, "--output", out, "--target", "tensorrt-rtx",
                            "--gpu-arch", "sm75", "--quant", "int8_sq", "--lm-head", "int4")  # int8_sq alone builds
    err = " ".join(err.split())
    assert code == 1 and "which --lm-head int4 needs; keep the head float (--lm-head float" in err, err
    assert not (root / "int8-engine.ckpt").exists()
    (root / "int8-engine.ckpt").mkdir()
    (root / "int8-engine.ckpt" / "notes.txt").write_text("mine")
    code, _, err = camshaft(capsys, "build", "--model", model, "--output", out, "--quant", "int8_wo")
    err = " ".join(err.split())
    assert code == 1 and "the quantized checkpoint --quant keeps beside --output, " in err, err
    assert (root / "int8-engine.ckpt" / "notes.txt").read_text() == "mine"
    shutil.rmtree(root / "int8-engine.ckpt")
    code, stdout, err = camshaft(capsys, "build", "--model", model, "--output", out, "--max-seq-len", "64",
                                 "--quant", "int8_wo", "--calib-size", "2", "--calib-seq-len", "32")
    assert code == 0, err
    assert stdout.strip() == str(out) and "engine for onnxruntime (float32, int8_wo)" in err  # what was built
    checkpoint = json.loads((root / "int8-engine.ckpt" / "hf_quant_config.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert checkpoint["quantization"]["quant_algo"] == manifest["quantization"]["quant_algo"] == "W8A16"
    code, _, err = camshaft(capsys, "run", "--engine", out, "--prompt", "hello", "--max-tokens", "3")
    assert code == 0, err
    code, described, _ = camshaft(capsys, "inspect", "--engine", out)
    assert "activations int8 dynamic per block" in described  # what --weight-only-compute chose


def test_build_for_a_product_that_is_not_installed_fails_before_any_work(tiny, capsys):
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    root, model = tiny
    out = root / "trt-engine"
    code, _, err = camshaft(capsys, "build", "--model", model, "--output", out, "--target", "tensorrt")
    assert code == 1 and "the tensorrt Python package" in err and "needs camshaft's tensorrt extra" in err
    assert "pip install 'camshaft[tensorrt]'" in err  # brackets print as written, not as console markup
    assert not out.exists() and not list(root.glob(".trt-engine*"))


def test_bench_latency_reports_the_graph_it_ran(capsys, engine, tmp_path):
    code, out, err = camshaft(capsys, "bench", "latency", "--engine", engine, "--prompt-len", 8, "--max-tokens", 4,
                              "--repeats", 2, "--warmup", 0, "--output-json", tmp_path / "latency.json")
    assert code == 0 and "run 2/2: 8 prompt tokens, 4 new" in err  # progress on stderr, the report alone on stdout
    report = dict(line.strip().split(": ", 1) for line in out.strip().splitlines())
    assert report["graph"] == "sequence" and report["output_tokens"] == "4" and float(report["decode_tok_s"]) > 0
    assert int(report["huge_pages_mib"]) >= 0
    written = json.loads((tmp_path / "latency.json").read_text())
    assert written["repeats"] == 2 and str(written["decode_tok_s"]) == report["decode_tok_s"]
    from camshaft.manifest import read_manifest  # which build, machine and software measured it: an A/B's sides
    assert written["build_id"] == read_manifest(engine).build_id and written["machine"]["available_cores"] >= 1
    assert written["machine"]["versions"]["onnxruntime"] == onnxruntime.__version__


def test_bench_latency_refuses_zero_repeats_from_python_too(engine):
    from camshaft.errors import RequestError
    from camshaft.runtime.bench import latency_benchmark

    with pytest.raises(RequestError, match="repeats must be an integer >= 1"):
        latency_benchmark(engine, repeats=0)


def test_bench_latency_names_its_own_options_when_too_long(capsys, engine):
    code, _, err = camshaft(capsys, "bench", "latency", "--engine", engine, "--prompt-len", 60, "--max-tokens", 10)
    assert code == 1 and "--prompt-len (60) + --max-tokens (10)" in err and "prompt_len" not in err


def test_counted_progress_is_shown_at_each_quarter_in_a_log(capsys):
    for i in range(1, 31):
        cli.progress(f"layer {i}/30")
    cli.progress("compiling")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[-1] for line in lines] == ["8/30", "16/30", "24/30", "30/30", "compiling"]


def test_counted_progress_on_a_terminal_clears_each_line_it_overwrites(monkeypatch):
    """The clear-to-end escape went through rich, which styled its "[": a bold "[K" ended every layer line."""
    import io

    from rich.console import Console

    screen = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=screen, force_terminal=True, width=40))
    cli.progress("sequence graph: layer 29/30")
    cli.progress("sequence graph: layer 30/30")
    shown = screen.getvalue()
    assert shown.count("\x1b[K") == 2 and shown.endswith("30\x1b[0m\x1b[K\n") and "\x1b[K\r" in shown
    assert "[K" not in shown.replace("\x1b[K", "")
    screen.truncate(0), screen.seek(0)
    cli._end_progress_line()  # no line open (a streamed reply's last line may be there): nothing erased
    assert screen.getvalue() == ""
    cli.progress("layer 3/30")
    cli._end_progress_line()  # before "interrupted" or an error: the open line cleared, once
    cli._end_progress_line()
    assert screen.getvalue().endswith("\r\x1b[K") and screen.getvalue().count("\r\x1b[K") == 1


def test_a_full_stdout_says_so_without_pointing_at_a_directory(tiny, capsys, monkeypatch):
    import errno
    from importlib import import_module

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(import_module("camshaft.builder.build"), "build_engine", full)
    root, model = tiny
    code, _, err = camshaft(capsys, "build", "--model", model, "--output", root / "full")
    assert code == 1 and "No space left on device (writing the output)" in err and "there" not in err


def test_a_full_disk_is_one_line_not_a_traceback(tiny, capsys, monkeypatch):
    import errno
    from importlib import import_module

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/engine/model.onnx.data")
    monkeypatch.setattr(import_module("camshaft.builder.build"), "build_engine", full)
    root, model = tiny
    code, _, err = camshaft(capsys, "build", "--model", model, "--output", root / "full")
    assert code == 1 and "Traceback" not in err
    assert "No space left on device: /data/engine/model.onnx.data; free some space" in " ".join(err.split())


def test_a_results_file_or_plot_that_cannot_be_written_keeps_the_earlier_one(tmp_path, monkeypatch):
    import errno
    import os

    from camshaft.cli.bench import write_json, write_plot
    from camshaft.errors import CamshaftError

    results = tmp_path / "results.json"
    results.write_text('{"earlier": 1}\n')

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CamshaftError, match="--output-json .*results.json could not be written .No space left"):
        write_json(results, {"later": 2})
    assert results.read_text() == '{"earlier": 1}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    with pytest.raises(CamshaftError, match="--plot .*plot.png could not be written .No space left on device"):
        write_plot(tmp_path / "plot.png", lambda path: full(0))


def test_a_results_file_is_written_through_its_symlink_with_its_mode_and_in_place_on_a_device(tmp_path):
    import stat

    from camshaft.cli.bench import write_json

    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    kept.chmod(0o600)
    (tmp_path / "link.json").symlink_to(kept)
    write_json(tmp_path / "link.json", {"later": 2})
    assert (tmp_path / "link.json").is_symlink() and json.loads(kept.read_text()) == {"later": 2}
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600  # not made readable by all
    write_json(Path("/dev/null"), {"x": 1})  # a device is written, not replaced by a file
    assert Path("/dev/null").is_char_device()
    script = ("import sys; from pathlib import Path; from camshaft.cli.bench import write_json; print('report'); "
              "write_json(Path(sys.argv[1]), {'results': 1})")
    redirected = tmp_path / "log.txt"
    redirected.write_text("earlier\n")
    with open(redirected, "a") as log:  # >> log.txt
        subprocess.run([sys.executable, "-c", script, "/dev/stdout"], stdout=log, check=True)
    assert redirected.read_text().startswith("earlier\nreport\n{") and redirected.read_text().endswith("1\n}\n")
    piped = subprocess.run([sys.executable, "-c", script, "/dev/stdout"], capture_output=True, text=True)  # | cat
    assert piped.returncode == 0 and piped.stdout.startswith("report\n{"), piped.stderr


@pytest.mark.parametrize("error, said", [
    (OSError(28, "No space left on device", "/ckpt/tokenizer.json", None, "/data/engine/tokenizer/tokenizer.json"),
     "No space left on device: /data/engine/tokenizer/tokenizer.json; free some space"),  # a copy's destination
    (MemoryError("Cannot allocate memory"), "out of memory (Cannot allocate memory): this machine's, or this "
                                            "process's limit (ulimit -v"),
    (OSError(27, "File too large", "/data/engine/graph.onnx.data"), "File too large: /data/engine/graph.onnx.data"),
])
def test_a_copy_onto_a_full_disk_or_no_memory_is_said_plainly(tiny, capsys, monkeypatch, error, said):
    from importlib import import_module

    def fail(*_args, **_kwargs):
        raise error
    monkeypatch.setattr(import_module("camshaft.builder.build"), "build_engine", fail)
    root, model = tiny
    code, _, err = camshaft(capsys, "build", "--model", model, "--output", root / "full")
    assert code == 1 and "Traceback" not in err and said in " ".join(err.split()), err


def test_build_quant_keeps_its_checkpoint_beside_an_output_given_as_dot(tmp_path, monkeypatch):
    from camshaft.cli.build import quantized_checkpoint

    monkeypatch.chdir(tmp_path)
    assert quantized_checkpoint(Path(".")) == tmp_path.parent / f"{tmp_path.name}.ckpt"


def test_a_kv_pool_beyond_the_machine_names_the_flag_once(engine, capsys):
    code, _, err = camshaft(capsys, "bench", "throughput", "--engine", engine, "--kv-cache-memory", "1TB",
                            "--num-requests", "2")
    assert code == 1 and "larger than this machine's" in err and err.count("--kv-cache-memory") == 1


def test_results_that_cannot_be_written_are_one_line_after_the_report(engine, capsys, monkeypatch, tmp_path):
    import errno
    import os

    results = tmp_path / "results.json"

    def disk_full(_fd):  # the disk filled up while the benchmark ran
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    code, out, err = camshaft(capsys, "bench", "throughput", "--engine", engine, "--num-requests", "2",
                              "--dataset", "synthetic:in=8,out=4", "--output-json", results)
    assert code == 1 and "GFLOP/s" in out  # the report came first
    assert "concurrency 32 (1/1): 2 requests" in err  # each level announced as it starts
    assert f"--output-json {results} could not be written (No space left on device)" in " ".join(err.split())
    assert "Traceback" not in err
    code, _, err = camshaft(capsys, "bench", "throughput", "--engine", engine, "--num-requests", "2",
                            "--dataset", "synthetic:in=8,out=4", "--output-json", "/proc/camshaft-results.json")
    assert code == 1 and "cannot be written" in err and "concurrency" not in err  # refused before any work


def test_a_model_hub_id_is_told_camshaft_reads_directories(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = camshaft(capsys, "build", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--output", "out")
    assert code == 1 and "not model hub ids: download the checkpoint to a directory first" in " ".join(err.split())
    (tmp_path / "out").mkdir()  # out/model with out/ here: a mistyped local path, not a hub id
    code, _, err = camshaft(capsys, "build", "--model", "out/model", "--output", "engine")
    assert code == 1 and "does not exist" in err and "hub" not in err
    code, _, err = camshaft(capsys, "models", "fetch", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert code == 1 and "not model hub ids" in " ".join(err.split()) and "smollm2-135m-instruct" in err
    (tmp_path / "notes.txt").write_text("text")  # a file: said so by every command that takes --model
    for command in (["build"], ["quantize", "--quant", "int8_wo"]):
        code, _, err = camshaft(capsys, *command, "--model", "notes.txt", "--output", "engine")
        assert code == 1 and "notes.txt is a file; --model takes a checkpoint directory" in err, command


def test_a_working_directory_replaced_from_under_the_shell_is_one_line(tmp_path):
    """A build or fetch into '.' moves a new directory in where the shell stands: the next command said a traceback
    (FileNotFoundError from getcwd)."""
    import subprocess

    script = ("import os, sys\nos.chdir(sys.argv[1])\nos.rmdir(sys.argv[1])\n"
              "sys.argv = ['camshaft', *sys.argv[2:]]\nfrom camshaft.cli import main\nmain()\n")
    (tmp_path / "gone").mkdir()
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "gone"), "build", "--model", ".", "--output",
                           "engine"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "the current directory no longer exists" in done.stderr and 'cd "$PWD"' in done.stderr
    (tmp_path / "gone").mkdir()  # what needs no directory still runs there
    assert subprocess.run([sys.executable, "-c", script, str(tmp_path / "gone"), "models", "list"],
                          capture_output=True, timeout=120).returncode == 0


CLI = [str(Path(sys.executable).parent / "camshaft")]


def test_output_on_a_closed_or_latin1_stdout_is_one_line_or_replaced(engine, tmp_path):
    """stdout closed (>&-): --stream gave a traceback, the others exit 0 having written nothing; a terminal whose
    encoding cannot show a character (a Latin-1 locale and an emoji) gave a traceback and lost the reply."""
    for command in (["run", "--engine", engine, "--prompt", "hi", "--max-tokens", "3", "--stream"],
                    ["inspect", "--engine", engine], ["models", "list"]):
        # the shell closes it: a preexec_fn runs in a fork of this process, where a library loaded by another test
        # (gRPC) may write to stderr between fork and exec
        done = subprocess.run(["bash", "-c", 'exec "$@" >&-', "bash", *CLI, *map(str, command)],
                              stderr=subprocess.PIPE, text=True)
        assert done.returncode == 1 and done.stderr.strip() == (
            "error: stdout is closed (>&-), so the output would be lost; redirect it (> FILE, or > /dev/null to "
            "drop it)"), done.stderr
    template = tmp_path / "emoji.jinja"
    template.write_text("{{ messages[0]['content'] }} 😀 θ")
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    done = subprocess.run([*CLI, "run", "--engine", str(engine), "--prompt", "hi", "--max-tokens", "2", "--chat",
                           "--chat-template", str(template), "--temperature", "0", "--stream"], env=env,
                          capture_output=True)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    encoded = subprocess.run([*CLI, "inspect", "--engine", str(engine)], env=env, capture_output=True)
    assert encoded.returncode == 0 and b"Traceback" not in encoded.stderr



def test_a_reader_that_goes_away_ends_run_as_sigpipe_would(tmp_path):
    """run --stream | head -c 1: click's handler exited 1 with nothing said, which a pipefail script takes for a
    failure; a process that loses its reader exits 141 (SIGPIPE's), as coreutils do."""
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    model = make_tiny_model("llama", tmp_path / "hf", max_position_embeddings=4096)
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=4096, max_num_tokens=64))
    process = subprocess.Popen([*CLI, "run", "--engine", str(tmp_path / "engine"), "--prompt", "hi", "--max-tokens",
                                "4000", "--stream", "--temperature", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)  # greedy: this model's 4000 tokens, no end id (sampled ones
    # ended after a few)
    assert process.stdout.read(1)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(60) == 141 and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


@pytest.mark.parametrize("args", [["--help"], ["models", "list"]])
def test_a_reader_gone_before_any_output_ends_every_command_as_sigpipe_would(args):
    """Review: only run exited 141; `camshaft --help | head -1` (click's handler) exited 1, which a pipefail script
    takes for a failure."""
    process = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # before the interpreter has started: its first write finds no reader
    stderr = process.stderr.read().decode()
    assert process.wait(60) == 141 and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


def test_a_benchmark_with_stdout_closed_and_no_json_is_refused_before_it_runs(engine, tmp_path):
    """Review: bench latency/throughput/serve ran with stdout closed and exited 0, their results lost."""
    for command in (["bench", "latency", "--engine", engine, "--repeats", "1", "--max-tokens", "2"],
                    ["bench", "throughput", "--engine", engine, "--num-requests", "1", "--dataset",
                     "synthetic:in=5,out=2"],
                    ["bench", "serve", "--target", f"a={engine},backend=llm", "--num-requests", "1", "--dataset",
                     "synthetic:in=5,out=2"]):
        # the shell closes it: a preexec_fn runs in a fork of this process, where a library loaded by another test
        # (gRPC) may write to stderr between fork and exec
        done = subprocess.run(["bash", "-c", 'exec "$@" >&-', "bash", *CLI, *map(str, command)],
                              stderr=subprocess.PIPE, text=True)
        assert done.returncode == 1 and done.stderr.strip() == (
            "error: stdout is closed (>&-), so the results would be lost; redirect it (> FILE) or give "
            "--output-json FILE"), done.stderr
    kept = tmp_path / "latency.json"  # the JSON keeps them
    done = subprocess.run(["bash", "-c", 'exec "$@" >&-', "bash", *CLI, "bench", "latency", "--engine", str(engine),
                           "--repeats", "1", "--max-tokens", "2", "--prompt-len", "8", "--output-json", str(kept)],
                          stderr=subprocess.PIPE, text=True)
    assert done.returncode == 0 and json.loads(kept.read_text())["repeats"] == 1, done.stderr


@pytest.mark.parametrize(("args", "shown"), [
    (["build", "--output", "{out}", "--max-seq-len", "1"], "[x>=2]"),  # help said x>=1; 1 was refused (exit 1)
    (["build", "--output", "{out}", "--max-batch-size", "100000"], "(at most 16384)"),
    (["build", "--output", "{out}", "--max-num-tokens", str(2**18 + 1)], "at most 262144)"),
    (["build", "--output", "{out}", "--kv-block-size", "7"], "(a power of two"),
    (["quantize", "--quant", "int8_wo", "--output", "{out}", "--calib-seq-len", "4"], "[x>=8]"),
    (["build", "--quant", "int8_wo", "--output", "{out}", "--calib-seq-len", "4"], "[x>=8]"),
])
def test_a_value_outside_a_flags_stated_range_is_a_usage_error(capsys, tiny, tmp_path, monkeypatch, args, shown):
    """Review: each was inside the range --help stated, then refused by the check behind it (exit 1)."""
    root, model = tiny
    code, _, err = camshaft(capsys, args[0], "--model", model, *(a.format(out=tmp_path / "out") for a in args[1:]))
    flag = args[-2]
    assert code == 2 and flag in err and not (tmp_path / "out").exists(), err
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = camshaft(capsys, args[0], "--help")
    assert code == 0 and any(flag in line and shown in line for line in out.splitlines()), out


def test_eval_windows_state_their_range(capsys, tiny, tmp_path, monkeypatch):
    root, model = tiny
    text = tmp_path / "t.txt"
    text.write_text("some text to score " * 20)
    code, _, err = camshaft(capsys, "eval", "ppl", "--data", text, "--model", model, "--window", "1")
    assert code == 2 and "--window" in err, err
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = camshaft(capsys, "eval", "ppl", "--help")
    assert code == 0 and any("--window" in line and "[x>=2]" in line for line in out.splitlines())
