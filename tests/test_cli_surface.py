"""Bad input on the serving, benchmark and eval commands: one clear error naming the user's flag, before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from camshaft.cli import app
from camshaft.errors import CamshaftError, RequestError
from camshaft.triton_repo.launch import free_port

from tiny_models import stamped, tiny_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("cli_surface"), max_seq_len=128, max_batch_size=4, max_num_tokens=64)


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(result, message: str) -> None:
    assert isinstance(result.exception, CamshaftError), result.output
    assert message in str(result.exception), str(result.exception)


@pytest.mark.parametrize("args, flag", [
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-queue", "-1"], "--max-queue"),
    (["serve", "--max-batch-size", "0"], "--max-batch-size"),
    (["run", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["build", "--model", ".", "--output", "e", "--max-batch-size", "0"], "--max-batch-size"),
    (["build", "--model", ".", "--output", "e", "--max-seq-len", "0"], "--max-seq-len"),
    (["build", "--model", ".", "--output", "e", "--max-num-tokens", "0"], "--max-num-tokens"),
    (["build", "--model", ".", "--output", "e", "--kv-block-size", "-8"], "--kv-block-size"),
    (["build", "--model", ".", "--output", "e", "--quant", "int8_wo", "--calib-size", "0"], "--calib-size"),
    (["quantize", "--model", ".", "--output", "q", "--quant", "int8_sq", "--calib-seq-len", "0"], "--calib-seq-len"),
    (["bench", "serve", "--target", "a=x,backend=llm", "--seed", "-1"], "--seed"),
    (["bench", "serve", "--target", "a=x,backend=llm", "--warmup", "-1"], "--warmup"),
])
def test_out_of_range_numbers_are_usage_errors(engine, args, flag):
    if args[0] in ("serve", "run"):
        args = [*args, "--engine", engine]
    result = invoke(*args)
    assert result.exit_code == 2 and flag in result.output, result.output


def test_threads_are_one_flag_everywhere_and_checked_before_loading(engine, tmp_path):
    cpus = len(os.sched_getaffinity(0))
    (tmp_path / "t.txt").write_text("some text to score")
    for command in (["serve"], ["serve", "--api", "openai"], ["run", "--prompt", "hi"], ["bench", "latency"],
                    ["bench", "throughput"], ["eval", "ppl", "--data", tmp_path / "t.txt"]):
        refused(invoke(*command, "--engine", engine, "--threads", cpus + 1),
                f"--threads {cpus + 1} is more than the {cpus} CPUs this process may use (those past them would only "
                f"take turns); pass at most {cpus}, or leave --threads unset for the backend's choice")
    refused(invoke("eval", "ppl", "--data", tmp_path / "t.txt", "--model", tmp_path, "--threads", "1"),
            "--threads sets the --engine's threads")
    refused(invoke("serve", "--repo", tmp_path, "--threads", "1"), "so --threads would be ignored")
    refused(invoke("bench", "serve", "--target", f"t={engine},backend=llm", "--threads", cpus + 1),
            f"--threads {cpus + 1} is more than the {cpus} CPUs")
    refused(invoke("bench", "serve", "--target", "o=http://127.0.0.1:9,backend=openai", "--threads", "1"),
            "--threads sets the engine threads of llm targets")
    done = invoke("bench", "latency", "--engine", engine, "--prompt-len", "4", "--max-tokens", "3", "--repeats", "1",
                  "--threads", "1", "--output-json", tmp_path / "latency.json")
    assert done.exit_code == 0 and json.loads((tmp_path / "latency.json").read_text())["threads"] == 1
    from camshaft.runtime.backends.onnxruntime import physical_cores

    done = invoke("bench", "latency", "--engine", engine, "--prompt-len", "4", "--max-tokens", "3", "--repeats", "1",
                  "--output-json", tmp_path / "default.json")  # the count the backend chose, not null
    assert done.exit_code == 0 and json.loads((tmp_path / "default.json").read_text())["threads"] == physical_cores()


def test_a_policy_refused_names_its_flag(engine, tmp_path):
    for command in (["serve", "--engine", engine], ["deploy", "--engine", engine, "--repo", tmp_path / "repo"],
                    ["bench", "throughput", "--engine", engine]):
        refused(invoke(*command, "--policy", "greedy"),
                "--policy must be one of guaranteed_no_evict, max_utilization (the capacity policies); got 'greedy'")
    assert not (tmp_path / "repo").exists()


def test_a_server_pool_must_hold_one_request_of_the_context_it_announces(engine, tmp_path):
    """vLLM refuses to start when its KV cache cannot hold one max_model_len request; a server taking requests its
    announced context admits and then refusing them (or capping them) misleads clients."""
    from camshaft.manifest import read_manifest
    from camshaft.openai_server.server import build_server
    from camshaft.runtime.kv_cache import bytes_per_block, memory_spec
    from camshaft.runtime.llm_options import least_text

    block = bytes_per_block(read_manifest(engine))  # max_seq_len 128: 4 blocks of 32 tokens, and the null block
    least = least_text(5 * block)  # the budget that holds them, rounded up to a whole KiB or MiB, no further
    assert 5 * block <= memory_spec(least) < 5 * block + 2**20 / 16
    short = ("the KV cache holds 3 blocks of 32 tokens, fewer than the 4 one request of the engine's max_seq_len 128 "
             "takes, so a server would refuse requests within the context it announces; raise --kv-cache-memory to "
             f"at least {least}, or serve an engine built with --max-seq-len 96 or less")
    for command in (["deploy", "--engine", engine, "--repo", tmp_path / "short"],  # first: the old code served on
                    ["serve", "--api", "openai", "--engine", engine], ["serve", "--engine", engine]):
        refused(invoke(*command, "--kv-cache-memory", 4 * block), short)
    assert not (tmp_path / "short").exists()
    with pytest.raises(CamshaftError, match="the KV cache holds 3 blocks of 32 tokens, fewer than the 4"):
        build_server(engine, host="127.0.0.1", port=0, llm_options={"kv_cache_memory": 4 * block})  # at load too
    done = invoke("deploy", "--engine", engine, "--repo", tmp_path / "enough", "--kv-cache-memory", least)
    assert done.exit_code == 0, done.output


def test_a_sliding_window_request_holds_its_window_at_most():
    from camshaft.runtime.scheduler_config import SchedulerConfig

    whole = SchedulerConfig(num_blocks=9, block_size=32, max_batch_size=2, max_num_tokens=64, max_seq_len=4096)
    sliding = SchedulerConfig(num_blocks=9, block_size=32, max_batch_size=2, max_num_tokens=64, max_seq_len=4096,
                              sliding_window=64)
    contiguous = SchedulerConfig(num_blocks=9, block_size=32, max_batch_size=2, max_num_tokens=64, max_seq_len=4096,
                                 sliding_window=64, kv_reservation="contiguous")
    assert (whole.full_length_blocks, sliding.full_length_blocks, contiguous.full_length_blocks) == (128, 6, 128)


def test_serve_refuses_ports_it_would_ignore_or_share(engine):
    refused(invoke("serve", "--api", "openai", "--engine", engine, "--grpc-port", "5"),
            "--api openai listens on --port only; --grpc-port sets Triton's")
    refused(invoke("serve", "--engine", engine, "--port", "18300", "--grpc-port", "18300"),
            "Triton needs three different ports")


def test_an_api_key_is_for_the_openai_api_and_not_blank(engine):
    refused(invoke("serve", "--engine", engine, "--api-key", "k"), "--api-key (or $CAMSHAFT_API_KEY) guards the OpenAI")
    from_env = CliRunner().invoke(app, ["serve", "--engine", str(engine)], env={"CAMSHAFT_API_KEY": "k"})
    refused(from_env, "Triton has no API keys")  # a key in the environment is not silently dropped
    refused(invoke("serve", "--engine", engine, "--api", "openai", "--api-key", " k"), "--api-key is empty or starts")
    refused(invoke("serve", "--engine", engine, "--log-level", "loud"),
            "unknown --log-level 'loud'; use debug, info, warning, error")


def test_a_tool_call_parser_is_for_the_openai_api_and_known(engine):
    refused(invoke("serve", "--engine", engine, "--tool-call-parser", "hermes"),
            "--tool-call-parser reads tool calls for the OpenAI API")
    refused(invoke("serve", "--engine", engine, "--api", "openai", "--tool-call-parser", "pythonic"),
            "unknown --tool-call-parser 'pythonic'; use hermes, llama3_json, mistral")
    refused(invoke("serve", "--engine", engine, "--chat-template", "t.jinja"),
            "--chat-template renders chat messages for the OpenAI API")
    refused(invoke("serve", "--engine", engine, "--allowed-origins", "*"),
            "--allowed-origins lets web pages call the OpenAI API")


def test_the_default_pool_is_checked_against_the_memory_there_is_too(engine, tmp_path, monkeypatch):
    """Unset, the pool holds max_batch_size full-length sequences: deploy warned and serve refused only a budget in
    bytes; the default one was found too large by the model's process, after tritonserver had started."""
    from camshaft.runtime import kv_cache

    (tmp_path / "memory.max").write_text("4096\n")  # a container of 4 KiB: the tiny engine's default pool is more
    (tmp_path / "self").write_text("0::/\n")
    monkeypatch.setattr(kv_cache, "CGROUP", tmp_path)
    monkeypatch.setattr(kv_cache, "SELF_CGROUP", tmp_path / "self")
    warned = invoke("deploy", "--engine", engine, "--repo", tmp_path / "repo")
    assert warned.exit_code == 0 and "warning: the KV cache pool" in warned.output
    assert "--kv-cache-memory" in warned.output and "kv_cache_memory" not in warned.output
    refused(invoke("serve", "--engine", engine, "--api", "openai"), "is larger than this machine's 0.0 GiB")


def test_deploy_names_its_own_flag_and_checks_a_byte_budget(engine, tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    refused(invoke("deploy", "--engine", engine, "--repo", not_a_dir), f"--repo {not_a_dir} exists")
    refused(invoke("deploy", "--engine", engine, "--repo", tmp_path / "repo", "--kv-cache-memory", "10"),
            "--kv-cache-memory 10 bytes holds no KV block")
    warned = invoke("deploy", "--engine", engine, "--repo", tmp_path / "big", "--kv-cache-memory", "1e15")
    assert warned.exit_code == 0 and "warning: the KV cache pool" in warned.output  # it may be served elsewhere
    assert "is larger than this machine's" in " ".join(warned.output.split())
    assert not (tmp_path / "repo").exists()
    result = invoke("deploy", "--engine", engine, "--repo", tmp_path / "repo", "--kv-cache-memory", "0.5")
    assert result.exit_code == 0, result.output  # a fraction is resolved where the engine loads
    monkeypatch.chdir(tmp_path)
    result = invoke("deploy", "--engine", engine, "--repo", "relative")
    assert result.exit_code == 0 and result.stdout == f"{tmp_path / 'relative'}\n"  # absolute, as build prints


def test_bench_refuses_unwritable_outputs_before_running(engine, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    refused(invoke("bench", "throughput", "--engine", engine, "--output-json", tmp_path), "is a directory")
    refused(invoke("bench", "throughput", "--engine", engine, "--plot", not_a_dir / "x.png"), "cannot be written")
    for plot in ("sweep.foo", "sweep"):  # a PNG, at the path given (not a crash after the run, nor sweep.png)
        refused(invoke("bench", "throughput", "--engine", engine, "--plot", tmp_path / plot), "ending in .png")
    usage = invoke("bench", "latency", "--engine", engine, "--max-tokens", "1")  # one token has no decode speed
    assert usage.exit_code == 2 and "greater than or equal to 2" in usage.output
    refused(invoke("bench", "serve", "--target", f"a={engine},backend=llm", "--output-json", not_a_dir / "x.json"),
            "cannot be written")


def test_bench_serve_names_a_missing_engine_and_an_unreachable_server(engine, tmp_path):
    refused(invoke("bench", "serve", "--target", f"a={tmp_path / 'nope'},backend=llm"), "does not exist")
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    refused(invoke("bench", "serve", "--target", f"a={url},backend=openai", "--tokenizer", engine,
                   "--dataset", "synthetic:in=8,out=4", "--num-requests", "2"),
            f"target a ({url}, backend openai) did not answer")


def test_eval_ppl_bad_data_and_a_window_without_model(engine, tmp_path):
    refused(invoke("eval", "ppl", "--engine", engine, "--data", tmp_path), "is a directory")
    binary = tmp_path / "bad.txt"
    binary.write_bytes(b"\xff\xfe\x00text")
    refused(invoke("eval", "ppl", "--engine", engine, "--data", binary), "is not UTF-8 text")
    text = tmp_path / "ok.txt"
    text.write_text("hello world " * 20)
    refused(invoke("eval", "ppl", "--engine", engine, "--data", text, "--window", "64"), "drop --window or add --model")


def _commands(group, path=()):
    for name, command in group.commands.items():
        yield (*path, name)
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


def test_every_help_reads_whole_at_80_columns():
    import typer.main

    for path in _commands(typer.main.get_command(app)):
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert result.exit_code == 0, (path, result.output)
        assert "…" not in result.output and "list[str]" not in result.output, (path, result.output)


def test_bracketed_words_in_help_survive_rich_markup():
    """Rich takes [build] in a help text for a markup tag and drops it (the --config help read "a table per command
    (, )"): brackets meant as text are escaped."""
    import re

    import typer.main

    root = typer.main.get_command(app)
    for path in [(), *_commands(root)]:
        command = root
        for name in path:
            command = command.commands[name]
        shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"}, terminal_width=200).output
        shown = " ".join(shown.replace("│", " ").split())
        for param in command.params:
            for word in re.findall(r"\[[^\]\s]+\]", (getattr(param, "help", None) or "").replace("\\[", "[")):
                assert word in shown, (path, param.name, word)


def test_every_command_opens_its_help_with_a_one_line_summary():
    """The command lists show a help's first paragraph with its line breaks, so a summary must fit one line."""
    import typer.main

    for path in _commands(typer.main.get_command(app)):
        command = typer.main.get_command(app)
        for name in path:
            command = command.commands[name]
        summary = (command.help or "").strip().split("\n\n")[0]
        assert summary and "\n" not in summary, (path, summary)


def test_both_throughput_benchmarks_take_the_same_dataset_presets():
    from camshaft.runtime.bench_data import parse_dataset_spec

    for preset in ("balanced", "prefill-heavy", "decode-heavy"):
        assert parse_dataset_spec(preset).kind == "synthetic"
    assert parse_dataset_spec("balanced") == parse_dataset_spec("synthetic:in=NORMAL(200,50),out=NORMAL(128,32)")
    with pytest.raises(RequestError, match="prefill-heavy: synthetic:in=NORMAL"):
        parse_dataset_spec("prefill")


def test_a_dataset_path_from_a_config_file_expands_its_tilde(tmp_path, monkeypatch):
    """Review: `dataset = "~/p.jsonl"` in a --config file was looked up as a directory named ~ (README: paths mean
    what they mean on the command line, ~ the home directory; --calib-data already expanded it)."""
    from camshaft.runtime.bench_data import parse_dataset_spec

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi", "max_tokens": 4}\n')
    for spec in ("~/p.jsonl", "jsonl:~/p.jsonl"):
        assert parse_dataset_spec(spec).path == tmp_path / "p.jsonl"


@pytest.mark.parametrize("command", ["serve", "deploy", "bench throughput"])
def test_llm_options_are_named_as_the_flags_typed(engine, tmp_path, command):
    extra = ["--repo", tmp_path / "repo"] if command == "deploy" else []
    result = invoke(*command.split(), "--engine", engine, *extra, "--max-batch-size", "64")
    refused(result, "--max-batch-size must be a positive integer up to the engine's 4")


def test_an_empty_served_name_is_refused(engine):
    refused(invoke("serve", "--api", "openai", "--engine", engine, "--name", " "), "--name is empty")


def test_inspect_says_what_an_engine_holds_and_refuses_a_broken_one(engine, tmp_path):
    import json
    import shutil

    from camshaft.manifest import read_manifest

    result = invoke("inspect", "--engine", engine, "--json")
    assert result.exit_code == 0, result.output
    info, manifest = json.loads(result.output), read_manifest(engine)
    c = manifest.model
    assert list(info) == [  # the keys README documents, in its order
        "engine", "format_version", "camshaft_version", "build_id", "model", "dtype", "quantization", "lm_head",
        "target",
        "device", "gpu_arch", "graphs", "prompt_lookup", "no_sequence_graph", "limits", "kv_cache", "files",
        "bytes_listed", "files_as_built", "fingerprinted", "eos_token_ids", "chat_template", "chat_template_problem",
        "tools", "runs_here", "runs_here_reason"]
    assert info["model"]["num_layers"] == c.num_layers and info["limits"]["max_seq_len"] == 128
    raw = json.loads((engine / "manifest.json").read_text())
    shared = set(info["model"]) & set(raw["model"])  # one vocabulary: a field the manifest has, by its name
    assert {"num_layers", "num_heads", "num_kv_heads", "tie_word_embeddings", "attention_scale",
            "attn_softcap", "local_rope", "rope"} <= shared
    for key in shared:
        value, recorded = info["model"][key], raw["model"][key]
        if key == "sampling_defaults":
            recorded = dict(recorded)
        elif isinstance(value, dict):  # rope: its main fields, and what follows from them (rotary_dim, ...)
            both = set(value) & set(recorded)
            value, recorded = {k: value[k] for k in both}, {k: recorded[k] for k in both}
        assert value == recorded, key
    assert info["kv_cache"]["bytes_per_token"] == c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4  # fp32 K and V
    assert info["kv_cache"]["default_pool_bytes"] == (4 * 128 + info["limits"]["kv_block_size"]) * \
        info["kv_cache"]["bytes_per_token"]  # 4 full sequences and the null block
    assert info["runs_here"] is True and info["runs_here_reason"] is None
    assert info["graphs"]["sequence"] == "sequence.onnx" and info["prompt_lookup"] is True
    assert info["files_as_built"] and info["bytes_listed"] == sum(
        f.stat().st_size for f in engine.rglob("*") if f.is_file() and f.name not in ("manifest.json",
                                                                                      "chat_template.jinja"))
    text = invoke("inspect", "--engine", engine)
    assert "runs here   yes" in text.output and f"{c.num_layers} layers" in text.output
    assert info["kv_cache"]["host_memory"] > info["kv_cache"]["default_pool_bytes"] and "more than" not in text.output
    from camshaft.runtime import kv_cache

    with pytest.MonkeyPatch.context() as patch:  # a container of 4 KiB: its default pool would not fit
        (tmp_path / "memory.max").write_text("4096\n")
        (tmp_path / "self").write_text("0::/\n")
        patch.setattr(kv_cache, "CGROUP", tmp_path)
        patch.setattr(kv_cache, "SELF_CGROUP", tmp_path / "self")
        small = invoke("inspect", "--engine", engine).output
    assert "more than this machine's 4.0 KiB: run or serve it with a smaller --kv-cache-memory or --max-batch-size" \
        in " ".join(small.split())
    assert info["fingerprinted"] and "sizes and fingerprints as the build recorded them" in text.output
    assert info["model"]["rope"]["type"] == "default" and ", rope " not in text.output
    broken = tmp_path / "broken"
    shutil.copytree(engine, broken)
    (broken / "model.onnx.data").write_bytes(b"\0" * (broken / "model.onnx.data").stat().st_size)
    described = invoke("inspect", "--engine", broken)  # still described, from its manifest, and exit status 1
    assert described.exit_code == 1 and f"{c.num_layers} layers" in described.output
    assert "runs here   no: " in described.output and "rebuild" in described.output
    assert "NOT as the build wrote them" in described.output
    refused(invoke("inspect", "--engine", tmp_path), "has no manifest.json")  # none at all: the usual error
    edited = tmp_path / "edited"  # a manifest field changed by hand, its files untouched: the manifest is blamed
    shutil.copytree(engine, edited)
    raw = json.loads((edited / "manifest.json").read_text())
    raw["limits"]["max_batch_size"] += 1
    (edited / "manifest.json").write_text(json.dumps(raw))
    described = invoke("inspect", "--engine", edited)
    assert described.exit_code == 1 and "runs here   no: " in described.output
    assert "NOT as the build wrote them" not in described.output and "as the build recorded them" in described.output
    older = tmp_path / "older"  # a sequence graph of one logits row, as engines built before prompt lookup
    shutil.copytree(engine, older)
    raw = json.loads((older / "manifest.json").read_text())
    raw["sequence_graph"]["inputs"] = [t for t in raw["sequence_graph"]["inputs"] if t["name"] != "num_logits"]
    (older / "manifest.json").write_text(json.dumps(stamped(raw)))
    described = invoke("inspect", "--engine", older).output  # its graph still takes num_logits: it does not run
    assert "(one logits row: prompt lookup on the batch graph only" in described
    assert "sequence.onnx's inputs differ from its manifest's (num_logits)" in described


def test_version_is_an_option_of_the_command():
    import camshaft

    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"camshaft {camshaft.__version__}"
    as_module = subprocess.run([sys.executable, "-m", "camshaft", "--version"], capture_output=True, text=True)
    assert (as_module.returncode, as_module.stdout.strip()) == (0, f"camshaft {camshaft.__version__}")
