"""Build outputs: what a killed build leaves is cleaned up by the next, an unwritable output and a checkpoint without
a tokenizer fail before any work, and a manifest that does not match its graph (logits, limits) is refused at load."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CamshaftError, CheckpointError, EngineError
from camshaft.outdir import staging_dir
from camshaft.runtime.engine import Engine
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model, stamped


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("outdir")
    model = make_tiny_model("llama", root / "hf")
    build_engine(BuildConfig(model, root / "engine", max_seq_len=64, kv_block_size=8))
    return model, root / "engine"


def test_an_output_name_near_the_filesystems_limit_builds(built, tmp_path):
    model, _ = built
    output = tmp_path / ("e" * 245)  # .NAME.partial-PID would pass 255 characters
    build_engine(BuildConfig(model, output, max_seq_len=64, kv_block_size=8))
    build_engine(BuildConfig(model, output, max_seq_len=64, kv_block_size=8))  # and replaces its own
    assert Engine(output).manifest.limits.max_seq_len == 64 and [p.name for p in tmp_path.iterdir()] == [output.name]


def test_a_compile_short_of_disk_or_memory_says_which(built, tmp_path, monkeypatch):
    import onnxruntime as ort

    from camshaft.builder.targets import onnxruntime as target
    from camshaft.errors import BuildConfigError

    _, engine = built
    graph = engine / "model.onnx"

    def fails(message):
        def session(*_args, **_kwargs):
            raise RuntimeError(message)
        monkeypatch.setattr(ort, "InferenceSession", session)
    fails("[ONNXRuntimeError] : 1 : FAIL : std::bad_alloc")
    with pytest.raises(MemoryError, match="ONNX Runtime ran out of memory compiling the graph"):
        target.compile_graph(graph, tmp_path / ".e.partial-1")  # not "N MB are free there": memory, not disk
    fails("[ONNXRuntimeError] : 1 : FAIL : write failed")
    monkeypatch.setattr(target.shutil, "disk_usage", lambda _path: shutil._ntuple_diskusage(10**9, 10**9, 10**5))
    with pytest.raises(BuildConfigError, match=rf"needs about \d+ MB in {tmp_path} and 0 MB were left there: free"):
        target.compile_graph(graph, tmp_path / ".e.partial-1")


def test_leftovers_of_nested_staging_long_byte_names_and_unreadable_mount_tables(tmp_path, monkeypatch):
    """build --quant quantizes into a staging directory, which quantize stages beside: a kill left that nested one
    for good; a name of 82 characters may be 246 bytes; a mount table may hold paths that are not UTF-8."""
    import errno

    from camshaft import outdir
    from camshaft.builder.graph.ops import weights_file

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    for name in ("e.ckpt", "模" * 64):  # a name past 186 bytes: its staging's own staging name is hashed
        staging = tmp_path / f"{outdir._hidden(tmp_path / name)}.partial-{dead}"
        nested = tmp_path / f"{outdir._hidden(staging)}.partial-{dead}"
        nested.mkdir()
        staging_dir(tmp_path / name)
        assert not nested.exists()
        shutil.rmtree(outdir._staging_path(tmp_path / name))
    wide = tmp_path / ("模型" * 41)  # 246 bytes
    staging = staging_dir(wide)
    (staging / "a").write_text("x")
    outdir.replace_dir(staging, wide)
    assert (wide / "a").read_text() == "x" and len(os.fsencode(staging.name)) <= 255
    table = tmp_path / "mountinfo"
    table.write_bytes(b"99 36 98:0 /src /mnt/bad\xffname rw - ext4 /dev/root rw\n")
    monkeypatch.setattr(outdir, "MOUNTINFO", table)
    assert not outdir.mount_point(tmp_path)  # not a UnicodeDecodeError
    with pytest.raises(OSError, match="No space left on device") as full, weights_file(tmp_path / "w.data"):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write, or the close flushing it, says it
    assert full.value.filename == str(tmp_path / "w.data")


def test_a_bind_mount_is_a_mount_point(tmp_path, monkeypatch):
    """os.path.ismount misses a bind mount within one filesystem: the whole build ran, then could not move."""
    from camshaft import outdir

    target = tmp_path / "bound here"
    target.mkdir()
    table = tmp_path / "mountinfo"
    table.write_text(f"36 35 98:0 / / rw - ext4 /dev/root rw\n"
                     f"99 36 98:0 /src {str(target).replace(' ', chr(92) + '040')} rw - ext4 /dev/root rw\n")
    monkeypatch.setattr(outdir, "MOUNTINFO", table)
    assert outdir.mount_point(target) and not outdir.mount_point(tmp_path)
    with pytest.raises(CamshaftError, match="is a mount point"):
        outdir.check_replaceable(target, "manifest.json", "an engine", CamshaftError)


def test_a_killed_runs_leftovers_are_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    leftovers = [tmp_path / f".engine.partial-{dead_pid}", tmp_path / f".engine.old-{dead_pid}"]
    live = tmp_path / f".engine.partial-{os.getppid()}"
    for path in [*leftovers, live, tmp_path / "engine"]:
        path.mkdir()
        (path / "graph.onnx.data").write_bytes(b"x" * 1000)
    staging = staging_dir(tmp_path / "engine")
    assert staging.is_dir() and not any(p.exists() for p in leftovers) and live.is_dir()


def test_an_output_a_killed_run_left_aside_goes_back_before_the_next_build(built, tmp_path, monkeypatch):
    """Killed between replace_dir's two moves (the OOM killer), a run leaves the previous engine as .engine.old-PID
    and no engine: the next build puts it back first, so a build that then fails late loses nothing."""
    from camshaft.builder import build

    model, engine = built
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    shutil.copytree(engine, tmp_path / f".engine.old-{int(dead.stdout)}")

    def fails_late(*args, **kwargs):
        raise CheckpointError("model.safetensors: a tensor holds NaN")

    monkeypatch.setattr(build, "write_graph", fails_late)
    with pytest.raises(CheckpointError, match="NaN"):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64, kv_block_size=8))
    assert sorted(os.listdir(tmp_path)) == ["engine"]
    with Session(tmp_path / "engine") as session:
        assert session.generate([5, 6], SamplingParams(max_tokens=2)).token_ids


def test_only_an_outputs_own_leftovers_are_touched_and_an_empty_output_takes_back_its_old(tmp_path):
    """.engine.int4.old-PID is engine.int4's (a build --quant keeps OUTPUT.ckpt beside OUTPUT): building engine
    neither takes it nor deletes it; an empty directory made before a retry (mkdir -p) does not cost the restore."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    sibling = tmp_path / f".engine.int4.old-{dead}"
    sibling.mkdir()
    (sibling / "manifest.json").write_text("engine.int4's")
    staging_dir(tmp_path / "engine")
    (tmp_path / "engine").mkdir()
    staging_dir(tmp_path / "engine")
    assert (sibling / "manifest.json").read_text() == "engine.int4's"
    own = tmp_path / f".retry.old-{dead}"
    own.mkdir()
    (own / "manifest.json").write_text("the previous retry")
    (tmp_path / "retry").mkdir()
    staging_dir(tmp_path / "retry")
    assert (tmp_path / "retry" / "manifest.json").read_text() == "the previous retry" and not own.exists()
    staging_dir(tmp_path / "engine.int4")
    assert (tmp_path / "engine.int4" / "manifest.json").read_text() == "engine.int4's"


def test_an_output_that_cannot_be_written_is_one_error_before_any_work(built, tmp_path, monkeypatch):
    """A path under a file: build refuses it first, and quantize before the model loads (it calibrated first)."""
    import transformers

    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    model, _ = built
    with pytest.raises(CamshaftError, match="--output /dev/null/engine cannot be written: /dev/null is a file"):
        build_engine(BuildConfig(model, "/dev/null/engine", max_seq_len=64))
    with pytest.raises(CamshaftError, match="--output / "):  # no parent at all
        build_engine(BuildConfig(model, "/", max_seq_len=64))
    (tmp_path / "afile").write_text("")

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the output was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(CamshaftError, match=f"{tmp_path / 'afile'} is a file; choose a path in a writable directory"):
        quantize_checkpoint(model, tmp_path / "afile" / "q", QuantSpec("int8_wo"), calib_size=4, calib_seq_len=64)
    if os.path.isdir("/proc/self"):  # writable as far as os.access tells root, yet nothing can be created there
        with pytest.raises(CamshaftError, match="--output /proc/q cannot be written: /proc is not a directory you can "
                                                "write to"):
            quantize_checkpoint(model, "/proc/q", QuantSpec("int8_wo"), calib_size=4, calib_seq_len=64)


def test_a_checkpoint_without_a_tokenizer_fails_before_the_graph_is_written(built, tmp_path, monkeypatch):
    model, _ = built
    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    (bare / "tokenizer.json").unlink()
    from camshaft.builder import build

    monkeypatch.setattr(build, "write_graph", lambda *a, **k: pytest.fail("the graph was written first"))
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        build_engine(BuildConfig(bare, tmp_path / "engine", max_seq_len=64))
    assert not list(tmp_path.glob(".engine.partial-*"))


def _wider(manifest: dict) -> None:
    manifest["model"]["vocab_size"] += 1
    manifest["outputs"][0]["shape"][-1] += 1


def _longer(manifest: dict) -> None:
    manifest["limits"]["max_seq_len"] *= 2


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["model"].update(vocab_size=m["model"]["vocab_size"] + 1), "the logits output is 384 wide"),
    (_wider, "logits dimensions"),  # the manifest consistent in itself: the graph says otherwise
    (lambda m: m["tools"].pop("onnxruntime"), "does not say which onnxruntime"),
    (_longer, r"built for max_seq_len 64 \(manifest: 128\)"),
])
@pytest.mark.parametrize("runner", [Engine, Session])
def test_a_manifest_that_disagrees_with_its_graph_is_refused(built, tmp_path, edit, message, runner):
    _, engine = built
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(stamped(manifest)))
    with pytest.raises(EngineError, match=message):
        runner(copy)


def test_rebuilding_keeps_what_camshaft_did_not_write(built, tmp_path):
    model, engine = built
    target = tmp_path / "engine"
    shutil.copytree(engine, target)
    (target / "LICENSE").write_text("the user's")
    with pytest.raises(CamshaftError, match="also holds LICENSE, which camshaft did not write"):
        build_engine(BuildConfig(model, target, max_seq_len=64, kv_block_size=8))
    assert (target / "LICENSE").read_text() == "the user's" and (target / "manifest.json").is_file()
    (target / "LICENSE").unlink()
    build_engine(BuildConfig(model, target, max_seq_len=32, kv_block_size=8))  # its own files: replaced
    assert Engine(target).limits.max_seq_len == 32


def test_a_directory_with_another_programs_manifest_is_not_an_engine(built, tmp_path):
    model, _ = built
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "my web app"}')
    (app / "model.onnx").write_text("the user's")
    with pytest.raises(CamshaftError, match="is a non-empty directory that is not an engine"):
        build_engine(BuildConfig(model, app, max_seq_len=32, kv_block_size=8))
    assert (app / "model.onnx").read_text() == "the user's"
    (app / "manifest.json").write_text('{"format_version": 4, "model": {')  # a damaged engine's: a rebuild mends it
    (app / "model.onnx").unlink()
    build_engine(BuildConfig(model, app, max_seq_len=32, kv_block_size=8))
    assert Engine(app).limits.max_seq_len == 32


def test_rebuilding_keeps_the_chat_templates_a_user_added_or_edited(built, tmp_path, monkeypatch):
    """The README lets users edit tokenizer/chat_template.jinja and add additional_chat_templates/: a rebuild refuses
    to delete or revert them before any work (build --quant: before calibrating), and rebuilds once they are moved
    out; a template the checkpoint itself changed since (a newer model revision) is no edit."""
    from camshaft import cli
    from camshaft.builder import build

    model, engine = built
    target = tmp_path / "engine"
    shutil.copytree(engine, target)
    template = target / "tokenizer" / "chat_template.jinja"
    original = template.read_text()
    with monkeypatch.context() as patched:
        patched.setattr(build, "save_tokenizer", lambda *a, **k: pytest.fail("the build started"))
        patched.setattr("camshaft.quantize.modelopt_adapter.quantize_checkpoint",
                        lambda *a, **k: pytest.fail("calibration started"))
        for change, kept in ((lambda: template.write_text(original + "{# mine #}"),
                              "tokenizer/chat_template.jinja (edited since the build)"),
                             (lambda: (target / "tokenizer" / "additional_chat_templates").mkdir(),
                              "tokenizer/additional_chat_templates")):
            change()
            with pytest.raises(CamshaftError, match=re.escape(kept) + ".*move them out of the engine first"):
                build_engine(BuildConfig(model, target, max_seq_len=32, kv_block_size=8))
            with pytest.raises(SystemExit):
                monkeypatch.setattr(sys, "argv", ["camshaft", "build", "--model", str(model), "--output", str(target),
                                                  "--quant", "int8_wo"])
                cli.main()
            assert Engine(target).limits.max_seq_len == 64 and not list(tmp_path.glob(".engine.*"))
    assert template.read_text() == original + "{# mine #}"
    template.write_text(original)
    (target / "tokenizer" / "additional_chat_templates").rmdir()
    newer = tmp_path / "newer"
    shutil.copytree(model, newer)
    (newer / "chat_template.jinja").write_text("{{ messages[0].content }}")
    build_engine(BuildConfig(newer, target, max_seq_len=32, kv_block_size=8))
    assert Engine(target).limits.max_seq_len == 32 and template.read_text() == "{{ messages[0].content }}"


def test_a_template_added_to_an_engine_built_without_one_is_kept(built, tmp_path):
    """A build without a chat template recorded none, so a template the user added since was deleted by a rebuild."""
    model, _ = built
    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    (bare / "chat_template.jinja").unlink()
    build_engine(BuildConfig(bare, tmp_path / "engine", max_seq_len=64, kv_block_size=8))
    added = tmp_path / "engine" / "tokenizer" / "chat_template.jinja"
    assert not added.exists()
    added.write_text("{{ messages[0].content }}")
    with pytest.raises(CamshaftError, match=re.escape("tokenizer/chat_template.jinja (added since the build)")):
        build_engine(BuildConfig(bare, tmp_path / "engine", max_seq_len=64, kv_block_size=8))
    assert added.read_text() == "{{ messages[0].content }}"


def test_an_engine_with_named_templates_rebuilds_in_place_and_keeps_their_edits(built, tmp_path):
    """transformers writes a checkpoint's named templates (tool_use, ...) to additional_chat_templates/; the build
    copies them, and its own rebuild was refused as if the user had added them."""
    from transformers import AutoTokenizer

    model, _ = built
    named = tmp_path / "named"
    shutil.copytree(model, named)
    tokenizer = AutoTokenizer.from_pretrained(named)
    tokenizer.chat_template = {"default": "{{ messages[0].content }}", "tool_use": "{{ tools }}"}
    tokenizer.save_pretrained(named)
    engine = tmp_path / "engine"
    build_engine(BuildConfig(named, engine, max_seq_len=64, kv_block_size=8))
    tool_use = engine / "tokenizer" / "additional_chat_templates" / "tool_use.jinja"
    assert tool_use.read_text() == "{{ tools }}"
    build_engine(BuildConfig(named, engine, max_seq_len=32, kv_block_size=8))  # untouched: rebuilt in place
    assert Engine(engine).limits.max_seq_len == 32
    for change, kept in ((lambda: tool_use.write_text("{{ tools }}{# mine #}"),
                          "tokenizer/additional_chat_templates/tool_use.jinja (edited since the build)"),
                         (lambda: (tool_use.parent / "rag.jinja").write_text("{{ documents }}"),
                          "tokenizer/additional_chat_templates/rag.jinja (added since the build)")):
        change()
        with pytest.raises(CamshaftError, match=re.escape(kept)):
            build_engine(BuildConfig(named, engine, max_seq_len=64, kv_block_size=8))
    assert Engine(engine).limits.max_seq_len == 32


def test_a_template_record_of_an_earlier_build_still_tells_an_edit(built, tmp_path):
    """Engines built before named templates were recorded hold the bare sha256 of chat_template.jinja."""
    import hashlib

    from camshaft.engine_files import TEMPLATE_RECORD, user_tokenizer_entries

    _, engine = built
    shutil.copytree(engine, tmp_path / "engine")
    tok_dir = tmp_path / "engine" / "tokenizer"
    template = tok_dir / "chat_template.jinja"
    (tok_dir / TEMPLATE_RECORD).write_text(hashlib.sha256(template.read_bytes()).hexdigest() + "\n")
    assert user_tokenizer_entries(tmp_path / "engine") == []
    template.write_text("{# mine #}")
    assert user_tokenizer_entries(tmp_path / "engine") == ["tokenizer/chat_template.jinja (edited since the build)"]


def test_an_output_that_is_a_symlink_or_dot_is_handled_before_any_work(built, tmp_path, monkeypatch):
    model, engine = built
    (tmp_path / "v1").mkdir()
    (tmp_path / "current").symlink_to(tmp_path / "v1")
    with pytest.raises(CamshaftError, match="is a symlink .*pass the directory itself"):
        build_engine(BuildConfig(model, tmp_path / "current", max_seq_len=64, kv_block_size=8))
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    build_engine(BuildConfig(model, ".", max_seq_len=64, kv_block_size=8))  # built beside it, moved into place
    assert (tmp_path / "here" / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "here", "v1"]


def test_a_failed_final_move_keeps_the_output_it_says_it_kept(built, tmp_path, monkeypatch):
    import camshaft.outdir

    model, engine = built
    target = tmp_path / "engine"
    shutil.copytree(engine, target)
    real_replace = os.replace

    def refuse_the_second(src, dst):
        if str(src).endswith(f".partial-{os.getpid()}") and str(dst) == str(target):
            raise OSError(16, "Device or resource busy")
        real_replace(src, dst)
    monkeypatch.setattr(camshaft.outdir.os, "replace", refuse_the_second)
    kept = set()
    for _ in range(2):  # a second failure in the same process keeps its output too
        with pytest.raises(CamshaftError, match=r"it is complete in .*\.engine\.failed-") as failed:
            build_engine(BuildConfig(model, target, max_seq_len=32, kv_block_size=8))
        kept.add(failed.value.args[0].rsplit("complete in ", 1)[1])
        assert Engine(target).limits.max_seq_len == 64  # the previous engine is back in place
    assert len(kept) == 2 and all((tmp_path / path.rsplit("/", 1)[1] / "manifest.json").is_file() for path in kept)


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_a_build_stopped_with_a_signal_says_so_and_leaves_nothing_behind(tmp_path, stop):
    """docker stop / a scheduler's eviction send SIGTERM: the build unwinds as on Ctrl-C (SIGINT); each says why."""
    import signal
    import time

    model = make_tiny_model("llama", tmp_path / "hf", num_hidden_layers=24)
    camshaft = [sys.executable, "-c", "from camshaft.cli import main; main()"]
    # a runner started in the background (`.ci/run &`) hands its children SIGINT ignored, which camshaft respects
    # as any program does (nohup): the build gets Ctrl-C's default back, as in a terminal
    build = subprocess.Popen([*camshaft, "build", "--model", str(model), "--output", str(tmp_path / "engine")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".engine.partial-*")) and build.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert build.poll() is None, "the build ended before it could be stopped"
    build.send_signal(getattr(signal, stop))
    _, err = build.communicate(timeout=60)
    assert build.returncode == 128 + getattr(signal, stop), err
    assert err.strip().endswith("terminated" if stop == "SIGTERM" else "interrupted"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_timeouts_second_sigterm_does_not_cut_the_unwinding_short(monkeypatch, capsys):
    """GNU timeout sends its SIGTERM to the process and again to its group: the second landed in the cleanup the
    first started (a build's staging directory being removed) and cut it short."""
    import os
    import signal

    import camshaft.cli as cli

    cleaned = []

    def stopped_then_stopped_again_while_cleaning_up():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("the first SIGTERM did not stop the command")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # to the process group, a moment later
            cleaned.append(True)

    monkeypatch.setattr(cli, "app", stopped_then_stopped_again_while_cleaning_up)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exited.value.code == 128 + signal.SIGTERM and cleaned == [True]
    assert capsys.readouterr().err.strip() == "terminated"


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_a_stop_that_turns_into_another_error_on_its_way_out_still_exits_as_that_stop(monkeypatch, capsys, stop):
    """A signal landing inside Python's import locks surfaces as their KeyError (seen in CI: a SIGTERM during a
    build's `from transformers import ...` exited 1 with a traceback): it is still a stop, with the stop's code."""
    import signal

    import camshaft.cli as cli

    def stopped_inside_an_import():
        try:
            if stop == "SIGTERM":
                cli._terminated(signal.SIGTERM, None)
            raise KeyboardInterrupt
        except BaseException:
            raise KeyError(12345)  # noqa: B904 (as the import system does: the stop is its __context__)

    monkeypatch.setattr(cli, "app", stopped_inside_an_import)
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 128 + getattr(signal, stop)
    assert capsys.readouterr().err.strip() == ("terminated" if stop == "SIGTERM" else "interrupted")


def test_a_stop_between_the_two_moves_puts_the_previous_output_back(tmp_path, monkeypatch):
    """replace_dir moves the old output aside, then the new one in: a Ctrl-C or SIGTERM between the two (the build's
    cleanup then deletes the new one) leaves the previous output in place, not only a hidden .old copy."""
    from camshaft.outdir import replace_dir

    output, staging = tmp_path / "engine", tmp_path / ".engine.partial-1"
    output.mkdir()
    (output / "manifest.json").write_text("old")
    staging.mkdir()
    (staging / "manifest.json").write_text("new")
    real, moves = os.replace, []

    def interrupted(src, dst):
        moves.append(dst)
        if len(moves) == 2:  # the new output's move: the stop lands first
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        replace_dir(staging, output)
    monkeypatch.setattr(os, "replace", real)
    assert (output / "manifest.json").read_text() == "old" and not list(tmp_path.glob(".engine.old-*"))


def test_every_file_of_a_finished_output_is_on_disk_before_it_is_moved_into_place(tmp_path, monkeypatch):
    """After a power loss the output is the old one or the whole new one: each file (the weights too, not only the
    manifest) and each directory is synced before the move, and the parent after it."""
    import camshaft.outdir as outdir

    synced: list[str] = []
    real_fsync = os.fsync
    moved = []

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src, dst):
        moved.append((str(src), len(synced)))
        os.rename(src, dst)

    staging = tmp_path / ".out.partial-1"
    (staging / "tokenizer").mkdir(parents=True)
    for name in ("model.onnx", "model.onnx.data", "tokenizer/tokenizer.json"):
        (staging / name).write_bytes(b"x" * 10)
    monkeypatch.setattr(outdir.os, "fsync", fsync)
    monkeypatch.setattr(outdir.os, "replace", replace)
    outdir.replace_dir(staging, tmp_path / "out")
    before_move = set(synced[:moved[0][1]])
    assert {str(staging / n) for n in ("model.onnx", "model.onnx.data", "tokenizer/tokenizer.json", "tokenizer")} \
        | {str(staging)} <= before_move
    assert synced[-1] == str(tmp_path) and (tmp_path / "out" / "model.onnx.data").read_bytes() == b"x" * 10


def test_syncing_skips_special_files_and_a_parent_it_cannot_read(tmp_path, monkeypatch):
    """A FIFO in the tree is not opened (it would block); a parent directory that cannot be synced after the move
    (one this user may write but not read) leaves the output in place, no error."""
    import camshaft.outdir as outdir

    staging = tmp_path / ".out.partial-1"
    staging.mkdir()
    (staging / "model.onnx").write_bytes(b"x")
    os.mkfifo(staging / "pipe")
    real = outdir._fsync

    def parent_refused(path):
        if path == tmp_path:
            raise PermissionError(13, "Permission denied")
        real(path)

    monkeypatch.setattr(outdir, "_fsync", parent_refused)
    outdir.replace_dir(staging, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (tmp_path / "out" / "model.onnx").is_file()


def test_a_stop_landing_as_the_staging_directory_is_made_leaves_nothing(built, tmp_path, monkeypatch):
    """A SIGTERM just after the build made its staging directory, before it began writing, left the directory
    behind (seen in CI); the same for deploy and a model fetch, which stage their output the same way."""
    from pathlib import Path

    from camshaft.models import fetch_model
    from camshaft.triton_repo.deploy import deploy_repository

    model, engine = built
    made = Path.mkdir

    def stopped_as_made(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if ".partial-" in self.name:
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", stopped_as_made)
    writers = {
        "engine": lambda: build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64)),
        "repo": lambda: deploy_repository(engine, tmp_path / "repo"),
        "model": lambda: fetch_model("smollm2-135m-instruct", tmp_path / "model"),
    }
    for name, write in writers.items():
        with pytest.raises(KeyboardInterrupt):
            write()
        assert list(tmp_path.iterdir()) == [], name


def test_two_threads_writing_one_output_are_refused_not_crossed(tmp_path):
    """Re-review: two threads of one process building into one --output shared the PID-named staging directory, so
    the second's start removed the first's files (FileNotFoundError deep in the graph writer); the second is refused.
    Two processes keep their own staging (the last to finish wins, as documented)."""
    import threading

    from camshaft.outdir import replace_dir, staged

    out, entered, leave = tmp_path / "engine", threading.Event(), threading.Event()

    def first() -> None:
        with staged(out) as staging:
            (staging / "a").write_text("first")
            entered.set()
            leave.wait(30)
            replace_dir(staging, out)

    thread = threading.Thread(target=first)
    thread.start()
    assert entered.wait(30)
    (tmp_path / "link").symlink_to(tmp_path)  # re-review: the same directory through a symlinked parent
    for spelling in (out, tmp_path / "link" / "engine", tmp_path / "x" / ".." / "engine/"):
        with pytest.raises(CamshaftError, match="is being written by another thread of this process"):
            with staged(spelling):
                pass
    leave.set()
    thread.join()
    assert (out / "a").read_text() == "first"
    with staged(out) as staging:  # free again once the first is done
        replace_dir(staging, out)
