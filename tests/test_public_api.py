"""What `import camshaft` offers: every exported name resolves, and the result types behave as documented."""

from __future__ import annotations

import os

import numpy as np

import camshaft
from camshaft.errors import CamshaftError

from tiny_models import tiny_engine


def test_every_exported_name_resolves_and_is_listed():
    assert set(camshaft._LAZY) <= set(camshaft.__all__)
    for name in camshaft.__all__:
        assert getattr(camshaft, name) is not None, name
    assert {"LLM", "Session", "SamplingParams", "GenerationResult", "build_engine", "quantize_checkpoint",
            "RequestError", "ServerBusyError"} <= set(dir(camshaft))
    assert issubclass(camshaft.ServerBusyError, CamshaftError) and camshaft.QuantizeError.__module__


def test_llm_takes_token_ids_in_any_sequence_and_outputs_forward_finish_reason(tmp_path):
    engine = tiny_engine(tmp_path, max_seq_len=64, max_batch_size=4)
    with camshaft.LLM(engine, threads=1) as llm:
        params = camshaft.SamplingParams(max_tokens=3, ignore_eos=True)
        as_list, as_tuple, as_array = (llm.generate(p, params, use_tqdm=False)
                                       for p in ([5, 6, 7], (5, 6, 7), np.array([5, 6, 7])))
        assert len(as_list) == len(as_tuple) == len(as_array) == 1
        assert as_list[0].token_ids == as_tuple[0].token_ids == as_array[0].token_ids
        assert as_list[0].finish_reason == "length"


def test_options_are_checked_where_they_are_taken_and_numpy_integers_are_plain_ints(tmp_path):
    """From a review of the public API: wrong types are RequestErrors naming the option (they reached onnxruntime as
    TypeErrors, or read 'false' as true); numpy integers are stored as ints (they broke the manifest's JSON); a
    Session's KV budget on the batch graph holds at most one full-length sequence; a quiet generate starts no tqdm
    thread; which of several prompts was refused is said; abort takes request ids only."""
    import threading

    import pytest

    from camshaft.builder.config import BuildConfig
    from camshaft.errors import RequestError
    from camshaft.quantize.spec import QuantizeError, QuantSpec

    config = BuildConfig(tmp_path / "hf", tmp_path / "out", max_batch_size=np.int64(4), max_seq_len=np.int32(64),
                         kv_block_size=np.int64(8))
    assert all(type(getattr(config, n)) is int for n in ("max_batch_size", "max_seq_len", "kv_block_size"))
    assert QuantSpec("int4_awq", exclude="*.mlp.down_proj").exclude == ("*.mlp.down_proj",)  # one pattern
    assert QuantSpec("int4_awq", exclude=None).exclude == () and QuantSpec("int4_awq", group_size=np.int64(64))
    for bad in (dict(exclude=[1]), dict(group_size=64.0), dict(format=["int4_awq"]), dict(kv_cache_dtype=["fp8"])):
        with pytest.raises(QuantizeError):
            QuantSpec(**{"format": "int4_awq", **bad})
    engine = tiny_engine(tmp_path, max_seq_len=64, max_batch_size=4)
    for bad, name in ((dict(threads=True), "threads"), (dict(threads=2.5), "threads"), (dict(threads=0), "threads"),
                      (dict(threads=len(os.sched_getaffinity(0)) + 1), "is more than the .* CPUs this process may use"),
                      (dict(spin_wait="false"), "spin_wait"), (dict(huge_pages="no"), "huge_pages")):
        with pytest.raises(RequestError, match=name):
            camshaft.LLM(engine, **bad)
    with pytest.raises(RequestError, match="huge_pages"):
        camshaft.Session(engine, huge_pages="no")
    with camshaft.Session(engine, graph="batch", kv_cache_memory="64MiB") as session:
        assert session.engine.engine.pool.num_blocks == session.manifest.limits.max_blocks_per_seq + 1
    before = set(threading.enumerate())  # thread objects: an earlier test's executor shares the name
    with camshaft.LLM(engine, threads=1) as llm:
        llm.generate([[5, 6]], camshaft.SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(RequestError, match=r"^prompt 1: "):
            llm.generate([[5, 6], [5] * 70], camshaft.SamplingParams(max_tokens=2))
        with pytest.raises(RequestError, match="the prompt is None"):
            llm.generate([None])
        for bad in (123, None, ["a", 1]):
            with pytest.raises(RequestError, match="abort takes a request id"):
                llm.abort(bad)
    assert set(threading.enumerate()) - before == set()


def test_a_progress_bar_leaves_no_thread_behind(tmp_path):
    """In a process of its own: tqdm's monitor thread, once started by any bar, outlives it."""
    import subprocess
    import sys

    engine = tiny_engine(tmp_path, max_seq_len=64, max_batch_size=4)
    script = ("import sys, threading, camshaft\n"
              "with camshaft.LLM(sys.argv[1], threads=1) as llm:\n"
              "    llm.generate([[5, 6], [7]], camshaft.SamplingParams(max_tokens=2), use_tqdm=True)\n"
              "print(sorted(t.name for t in threading.enumerate()))\n")
    done = subprocess.run([sys.executable, "-c", script, str(engine)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2/2" in done.stderr and done.stdout.strip() == "['MainThread']"


# onnxruntime keeps its telemetry off itself where one of these says it runs in CI (CI runs this test)
_ORT_QUIET = {"ORT_DISABLE_TELEMETRY", "CI", "TF_BUILD", "GITHUB_ACTIONS", "GITLAB_CI", "CIRCLECI", "TRAVIS",
              "JENKINS_URL", "CODEBUILD_BUILD_ID", "BUILDKITE", "TEAMCITY_VERSION", "APPVEYOR",
              "BITBUCKET_BUILD_NUMBER"}


def test_onnx_runtimes_telemetry_is_off_unless_asked_for(tmp_path):
    """ONNX Runtime 1.32 uploads usage telemetry by default and keeps a device id and an event cache in ~/.cache:
    camshaft turns it off; ORT_DISABLE_TELEMETRY set by the user is kept."""
    import subprocess
    import sys

    engine = tiny_engine(tmp_path)
    script = ("import camshaft, onnxruntime, sys; "
              "onnxruntime.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])")
    kept = {}
    for given in (None, "0"):
        home = tmp_path / f"home-{given}"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in _ORT_QUIET} | {"HOME": str(home)}
        done = subprocess.run([sys.executable, "-c", script, str(engine / "model.onnx")], capture_output=True,
                              text=True, env=env | ({} if given is None else {"ORT_DISABLE_TELEMETRY": given}))
        assert done.returncode == 0, done.stderr
        kept[given] = sorted(p.name for p in home.rglob("*") if p.is_file())
    assert kept == {None: [], "0": ["deviceid", "onnxruntime.db"]}


def test_engines_built_and_loaded_from_several_threads_at_once_all_load(tmp_path):
    """Review: an app warming its models in a thread pool lost all but one to ImportError ('cannot import name
    PreTrainedTokenizerFast'): transformers' lazy module is not safe to import from several threads at first; a
    re-review found the same with a chat_template given to one load, and with engines built in threads."""
    import subprocess
    import sys

    from tiny_models import make_tiny_model

    names = ("llama", "qwen2-bias", "llama")
    models = [make_tiny_model(name, tmp_path / f"{i}-{name}") for i, name in enumerate(names)]
    script = ("import sys, camshaft\n"
              "from concurrent.futures import ThreadPoolExecutor\n"
              "from camshaft.builder.build import build_engine\n"
              "from camshaft.builder.config import BuildConfig\n"
              "models = sys.argv[1:]\n"
              "def build(i):\n"
              "    build_engine(BuildConfig(models[i], models[i] + '-engine', max_seq_len=32, max_batch_size=2))\n"
              "    return models[i] + '-engine'\n"
              "with ThreadPoolExecutor(3) as pool:\n"
              "    engines = list(pool.map(build, range(3)))\n"
              "TPL = \"{% for m in messages %}{{ m['content'] }}{% endfor %}\"\n"
              "def load(i):\n"
              "    kind = camshaft.LLM if i % 2 else camshaft.Session\n"
              "    with kind(engines[i % 3], threads=1, chat_template=TPL if i < 2 else None):\n"
              "        return kind.__name__\n"
              "with ThreadPoolExecutor(6) as pool:\n"
              "    print(sorted(pool.map(load, range(6))))\n")
    done = subprocess.run([sys.executable, "-c", script, *map(str, models)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(["LLM"] * 3 + ["Session"] * 3)
