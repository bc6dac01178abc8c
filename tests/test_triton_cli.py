"""`camshaft deploy` writes a complete repository (no template placeholders); `camshaft serve --engine` starts the
bundled tritonserver, answers, and exits cleanly on SIGINT."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CamshaftError, RequestError, ServerClosedError
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.triton_repo.deploy import MARKER, deploy_repository
from camshaft.triton_repo.launch import free_port, free_ports
from camshaft.triton_repo.protocol import error_status
from camshaft.triton_repo.server import TritonServer

from tiny_models import make_tiny_model

CAMSHAFT = [str(Path(sys.executable).parent / "camshaft")]  # the installed console script


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("triton_cli")
    build_engine(BuildConfig(make_tiny_model("llama", root / "hf"), root / "my engine", max_seq_len=128,
                             max_num_tokens=64, max_batch_size=4))
    return root / "my engine"  # a space: the engine's path reaches the models as a parameter, which holds it


def test_deploy_writes_a_complete_repository(engine, tmp_path):
    repo = tmp_path / "repo"
    done = subprocess.run([*CAMSHAFT, "deploy", "--engine", str(engine), "--repo", str(repo), "--name", "llm",
                           "--kv-cache-memory", "8MiB", "--max-queue", "5", "--max-num-tokens", "32"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    configs = {p.parent.name: p.read_text() for p in repo.glob("*/config.pbtxt")}
    assert sorted(configs) == ["llm", "llm_sync", "tensorrt_llm", "tensorrt_llm_bls"]
    assert all("${" not in text for text in configs.values())
    assert all((repo / name / "1" / "model.py").is_file() for name in configs)
    assert "decoupled: true" in configs["llm"] and "decoupled: false" in configs["llm_sync"]
    # the token model takes one prompt a request under any ensemble's batch bound; the text models batch
    assert f'"{engine.absolute()}"' in configs["tensorrt_llm"] and "max_batch_size: 1024" in configs["tensorrt_llm"]
    assert "max_batch_size: 4" in configs["llm"] and "max_batch_size: 4" in configs["llm_sync"]
    from camshaft.triton_repo.parameters import TEXT_MODEL_PARAMETERS, TOKEN_MODEL_PARAMETERS

    keys = {name: set(re.findall(r'key: "(\w+)"', text)) for name, text in configs.items()}  # what each model reads
    assert keys == {"tensorrt_llm": TOKEN_MODEL_PARAMETERS, "llm": TEXT_MODEL_PARAMETERS,
                    "llm_sync": TEXT_MODEL_PARAMETERS, "tensorrt_llm_bls": TEXT_MODEL_PARAMETERS}
    options = json.loads((repo / MARKER).read_text())["llm_options"]
    assert options == {"kv_cache_memory": 8 * 2**20, "max_queue": 5, "max_num_tokens": 32,
                       "policy": "guaranteed_no_evict"}
    done = subprocess.run([*CAMSHAFT, "deploy", "--engine", str(engine), "--repo", str(tmp_path / "default")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    marker = json.loads((tmp_path / "default" / MARKER).read_text())
    assert marker["llm_options"]["max_queue"] == 4 * 4 and "threads" not in marker["llm_options"]
    done = subprocess.run([*CAMSHAFT, "deploy", "--engine", str(engine), "--repo", str(tmp_path / "threads"),
                           "--threads", "4096"], capture_output=True, text=True)  # for the machine that serves it
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "threads" / MARKER).read_text())["llm_options"]["threads"] == 4096
    assert "decoupled: true" in (tmp_path / "default" / "tensorrt_llm" / "config.pbtxt").read_text()
    scratch = engine.parent / f"scratch-{tmp_path.name}"  # a CI job's, removed once it deployed
    scratch.mkdir()
    done = subprocess.run([*CAMSHAFT, "deploy", "--engine", f"../{engine.name}", "--repo", str(tmp_path / "dotdot")],
                          capture_output=True, text=True, cwd=scratch)
    scratch.rmdir()
    assert done.returncode == 0, done.stderr
    assert f'"{engine}"' in (tmp_path / "dotdot" / "tensorrt_llm" / "config.pbtxt").read_text()
    done = subprocess.run([*CAMSHAFT, "deploy", "--engine", str(engine), "--repo", str(tmp_path / "my repo")],
                          capture_output=True, text=True)  # Triton's python stubs crash on such a path: refused
    assert done.returncode == 1 and "holds whitespace" in done.stderr and not (tmp_path / "my repo").exists()
    shutil.copytree(tmp_path / "default", tmp_path / "copied repo")
    with pytest.raises(CamshaftError, match="the model repository .* holds whitespace"):
        TritonServer(tmp_path / "copied repo")
    (tmp_path / "éngine").symlink_to(engine)  # review: a non-ASCII repository deployed, then never loaded; an engine
    for args, flag in ((["--engine", str(engine), "--repo", str(tmp_path / "répo")], "--repo"),  # read as missing
                       (["--engine", str(tmp_path / "éngine"), "--repo", str(tmp_path / "ascii")], "--engine")):
        done = subprocess.run([*CAMSHAFT, "deploy", *args], capture_output=True, text=True)
        assert done.returncode == 1 and f"{flag} " in done.stderr and "holds non-ASCII characters (é)" in done.stderr
    assert not (tmp_path / "répo").exists() and not (tmp_path / "ascii").exists()
    done = subprocess.run([*CAMSHAFT, "deploy", "--engine", str(engine), "--repo", str(tmp_path / "sync"),
                           "--no-decoupled"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # tensorrtllm_backend's decoupled_mode false: no model decoupled
    for model in ("tensorrt_llm", "ensemble", "ensemble_sync", "tensorrt_llm_bls"):
        assert "decoupled: false" in (tmp_path / "sync" / model / "config.pbtxt").read_text()
    assert "decoupled: true" in (tmp_path / "default" / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    assert json.loads((tmp_path / "sync" / MARKER).read_text())["decoupled"] is False
    assert 'string_value: "20"' in (tmp_path / "default" / "ensemble" / "config.pbtxt").read_text()  # max_requests
    done = subprocess.run([*CAMSHAFT, "deploy", "--engine", str(engine), "--repo", str(tmp_path / "fraction"),
                           "--kv-cache-memory", "0.25"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # a fraction of the serving machine's memory, resolved there
    assert json.loads((tmp_path / "fraction" / MARKER).read_text())["llm_options"]["kv_cache_memory"] == 0.25
    done = subprocess.run([*CAMSHAFT, "deploy", "--engine", str(engine), "--repo", str(tmp_path / "too-big"),
                           "--max-batch-size", "99"], capture_output=True, text=True)
    assert done.returncode == 1 and "up to the engine's 4" in done.stderr and not (tmp_path / "too-big").exists()
    done = subprocess.run([*CAMSHAFT, "serve", "--repo", str(repo), "--max-queue", "3", "--policy",
                           "max_utilization"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "--max-queue, --policy would be ignored" in done.stderr  # not silently dropped
    for where in (["--repo", str(repo)], ["--engine", str(engine), "--api", "openai"]):
        done = subprocess.run([*CAMSHAFT, "serve", *where, "--no-decoupled"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 1 and "--no-decoupled sets how Triton's models are deployed" in done.stderr
    deploy_repository(engine, repo, name="again")  # a camshaft repository is replaced
    assert sorted(p.parent.name for p in repo.glob("*/config.pbtxt")) == ["again", "again_sync", "tensorrt_llm",
                                                                          "tensorrt_llm_bls"]
    with pytest.raises(CamshaftError, match="other than tensorrt_llm, tensorrt_llm_bls and camshaft_repository.json"):
        deploy_repository(engine, tmp_path / "marker", name="camshaft_repository.json")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(CamshaftError, match="refusing to overwrite"):
        deploy_repository(engine, tmp_path / "other")
    (repo / "notes.md").write_text("the operator's")  # a redeploy would delete it with the repository
    with pytest.raises(CamshaftError, match="also holds notes.md, which camshaft did not write"):
        deploy_repository(engine, repo, name="again")
    (repo / "notes.md").unlink()
    shutil.copytree(engine, repo / "engines_llama")
    with pytest.raises(CamshaftError, match="lies inside --repo"):
        deploy_repository(repo / "engines_llama", repo, name="again")
    assert (repo / "engines_llama" / "manifest.json").is_file()


def test_deploy_into_the_working_directory_prints_it(engine, tmp_path):
    """Review: `deploy --repo .` wrote the repository, then failed (the directory it printed had been replaced), so
    `deploy ... && serve ...` stopped there."""
    here = tmp_path / "here"
    here.mkdir()
    done = subprocess.run([*CAMSHAFT, "deploy", "--engine", str(engine), "--repo", "."], cwd=here,
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == str(here), done.stderr
    assert (here / "tensorrt_llm" / "config.pbtxt").is_file()


def test_deploy_again_refuses_to_lose_what_was_edited_or_added_inside_the_models(engine, tmp_path):
    repo = deploy_repository(engine, tmp_path / "repo")
    cache = repo / "ensemble" / "1" / "__pycache__"  # what Triton's stubs leave: not the user's, no obstacle
    cache.mkdir()
    (cache / "model.cpython-311.pyc").write_bytes(b"bytecode")
    deploy_repository(engine, repo)
    config = repo / "ensemble" / "config.pbtxt"
    config.write_text(config.read_text().replace("count: 1", "count: 4"))
    (repo / "tensorrt_llm" / "2").mkdir()
    (repo / "tensorrt_llm" / "2" / "model.py").write_text("# mine")
    with pytest.raises(CamshaftError, match=r"holds ensemble/config\.pbtxt \(edited\), tensorrt_llm/2/model\.py "
                                            r"\(added\) since camshaft deploy wrote it, which deploying again would "
                                            "lose; move them aside"):
        deploy_repository(engine, repo)
    assert "count: 4" in config.read_text() and (repo / "tensorrt_llm" / "2" / "model.py").read_text() == "# mine"
    shutil.rmtree(repo / "tensorrt_llm" / "2")
    config.write_text(config.read_text().replace("count: 4", "count: 1"))
    deploy_repository(engine, repo)


def test_a_model_refuses_config_parameters_it_would_ignore(engine, tmp_path):
    """tensorrtllm_backend's names (max_queue_size, ...) added to a camshaft model's config.pbtxt fail its load, naming
    camshaft's equivalent, instead of loading with them ignored."""
    repo = deploy_repository(engine, tmp_path / "repo")
    config = repo / "tensorrt_llm" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters {\n  key: "max_queue_size"\n  value { string_value: "0" }\n}\n')
    with pytest.raises(CamshaftError) as failed:
        TritonServer(repo, ready_timeout_s=120).start()
    message = " ".join(str(failed.value).split())
    assert "tensorrt_llm: config.pbtxt parameter(s) max_queue_size are not read here and would be ignored" in message
    assert "for max_queue_size use camshaft deploy --max-queue (llm_options key max_queue)" in message


def start_serve(engine: Path, *options: str, env: dict | None = None) -> tuple[subprocess.Popen, list[str], list[str]]:
    """`camshaft serve --engine` on free ports, once it says it is ready: (the process, its ports, its stderr lines
    so far and to come)."""
    ports = [str(port) for port in free_ports("127.0.0.1", 3)]
    server = subprocess.Popen([*CAMSHAFT, "serve", "--engine", str(engine), "--port", ports[0], "--grpc-port",
                               ports[1], "--metrics-port", ports[2], *options], stderr=subprocess.PIPE, text=True,
                              env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in server.stderr:
            lines.append(line)
            if "ready:" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120) or server.poll() is not None:
        server.kill()
        server.wait()
        pytest.fail("camshaft serve did not get ready:\n" + "".join(lines))
    return server, ports, lines


def test_serve_engine_answers_and_stops_on_sigint(engine):
    server, ports, lines = start_serve(engine, "--max-queue", "8", "--name", "llm", "--no-decoupled")
    try:
        url = f"http://127.0.0.1:{ports[0]}/v2/models/llm/generate"
        close = {"Connection": "close"}  # an open keep-alive connection holds Triton's exit for its exit timeout
        answer = requests.post(url, json={"text_input": "hello", "max_tokens": 4}, headers=close, timeout=60)
        assert answer.status_code == 200 and answer.json()["text_output"].startswith("hello")
        infer = requests.post(f"http://127.0.0.1:{ports[0]}/v2/models/llm/infer", headers=close, timeout=60, json={
            "inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]},
                       {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [4]}]})
        assert infer.status_code == 200, infer.text  # --no-decoupled: plain infer on the served model itself
        assert "camshaft_kv_cache_blocks_total" in requests.get(f"http://127.0.0.1:{ports[2]}/metrics",
                                                                 headers=close, timeout=10).text
        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 0, "".join(lines)
        assert any("stopped" in line for line in lines)
        assert any("models: " in line and line.rstrip().endswith(url) for line in lines), lines
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_stop_with_an_idle_grpc_stream_open_ends_soon_after_the_exit_timeout(engine):
    """A client's gRPC stream left open (its request answered) keeps the model it used loaded: Triton 2.51 gives up at
    its exit timeout but hangs; serve waited 15 s more before killing it (a gateway's long-lived stream hits this on
    every restart). It now kills tritonserver once Triton says it gave up, and says why."""
    import tritonclient.grpc as grpcclient
    from test_triton import Stream, tensors

    server, ports, lines = start_serve(engine)
    stream = Stream(f"127.0.0.1:{ports[1]}").send("ensemble", tensors(grpcclient, text_input="hello", max_tokens=4,
                                                                       stream=True))
    try:
        while not stream.responses.get(timeout=60)[0].get_response().parameters["triton_final_response"].bool_param:
            pass
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        assert any("tritonserver gave up unloading at its exit timeout but did not exit (the known cause: a "
                   "client's gRPC stream left open" in line for line in lines), "".join(lines)
        assert not any("did not exit 25 s after the signal" in line for line in lines)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        stream.close()


def test_timeouts_sigterm_sent_twice_is_one_stop(engine):
    """GNU timeout sends its SIGTERM to serve and again to its process group: the second, just after the first, was
    taken for "a second signal" and killed tritonserver instead of draining it (seen once in seven runs)."""
    server, _, lines = start_serve(engine)
    try:
        server.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not any("got SIGTERM" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.01)
        server.send_signal(signal.SIGTERM)  # the same stop, to the group
        assert server.wait(60) == 0, "".join(lines)
        assert not any("killing" in line for line in lines) and lines[-1].strip().endswith("stopped"), "".join(lines)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_killed_serve_takes_its_tritonserver_with_it_and_ignores_http_proxy(engine, tmp_path):
    """SIGKILL (or the OOM killer) leaves camshaft no chance to stop Triton: the kernel does (PR_SET_PDEATHSIG), so
    no orphan keeps serving and holding the ports. The readiness poll of our own loopback server never goes through
    $http_proxy (here a proxy that refuses everything)."""
    import os

    import psutil

    env = {**os.environ, "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "TMPDIR": str(tmp_path)}  # a killed serve cannot remove its temporary repository: it stays in the test's
    serve, _, lines = start_serve(engine, env=env)
    triton = []
    try:
        triton = [p for p in psutil.Process(serve.pid).children() if p.name() == "tritonserver"]
        group = [p for p in psutil.process_iter() if _pgid(p.pid) == triton[0].pid]  # tritonserver and its stubs
        serve.kill()
        serve.wait()
        gone, alive = psutil.wait_procs(group, timeout=60)
        assert not alive, alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(serve.pid, signal.SIGKILL)
        for process in triton:  # and its stubs, which share its process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.parametrize("victim", ["stub", "tritonserver"])
def test_serve_stops_with_an_error_when_a_models_process_dies(engine, tmp_path, victim):
    """Triton neither restarts a python backend stub that died nor stops answering ready; its requests fail or wait.
    camshaft serve says which model died and exits 1, so a supervisor restarts the server whole. A tritonserver
    stopped by someone else is said as that (it was said to be a model's process dying, out of memory?)."""
    import os

    import psutil

    serve, _, lines = start_serve(engine, env={**os.environ, "TMPDIR": str(tmp_path)})  # its kept log there
    triton = None
    try:
        (triton,) = [p for p in psutil.Process(serve.pid).children() if p.name() == "tritonserver"]
        (stub,) = [p for p in triton.children() if "/tensorrt_llm/1/model.py" in " ".join(p.cmdline())]
        os.kill(stub.pid if victim == "stub" else triton.pid, signal.SIGKILL if victim == "stub" else signal.SIGTERM)
        assert serve.wait(60) == 1, "".join(lines)
        assert not triton.is_running() or triton.status() == psutil.STATUS_ZOMBIE
        text = " ".join("".join(lines).split())
        said = ("the process serving the model(s) tensorrt_llm died" if victim == "stub" else
                "tritonserver exited by itself with code 0")
        assert said in text, text
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        if triton is not None:  # and its stubs, which share its process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(triton.pid, signal.SIGKILL)


def test_a_stub_that_dies_as_serve_says_ready_is_still_seen(engine, tmp_path, monkeypatch):
    """serve listed the stubs to watch after saying "ready": one that died in between (as the test above
    killed it, twice in five runs here) was never watched, and serve ran on with a model that answers nothing."""
    import os

    import psutil

    from camshaft.triton_repo.serve import serve

    def kill_stub_when_ready(line: str) -> None:
        if line.startswith("ready:"):
            (triton,) = [p for p in psutil.Process().children() if p.name() == "tritonserver"]
            (stub,) = [p for p in triton.children() if "/tensorrt_llm/1/model.py" in " ".join(p.cmdline())]
            stub.kill()
            deadline = time.monotonic() + 10
            while stub.is_running() and stub.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
                time.sleep(0.05)

    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the log serve keeps of a failed server: the test's
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # and the stubs', where their channel's socket is (as serve's)
    rescue = threading.Timer(60, os.kill, (os.getpid(), signal.SIGTERM))  # the old code ran on until stopped
    rescue.start()
    try:
        with pytest.raises(CamshaftError, match=r"the process serving the model\(s\) tensorrt_llm died"):
            serve(engine=None, repo=deploy_repository(engine, tmp_path / "repo"), host="127.0.0.1", http_port=0,
                  grpc_port=0, metrics_port=0, llm_options={}, log=kill_stub_when_ready)
    finally:
        rescue.cancel()


def test_a_serve_refused_before_tritonserver_starts_leaves_no_log(engine, tmp_path, monkeypatch):
    import socket
    import tempfile

    from camshaft.triton_repo.serve import serve

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    repo = deploy_repository(engine, tmp_path / "repo")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for bad, message in (({"repo": tmp_path}, "not a model repository"),
                             ({"repo": repo, "http_port": taken.getsockname()[1]}, "is in use")):
            options = {"engine": None, "host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "metrics_port": 0,
                       "llm_options": {}, "log": lambda _: None, **bad}
            with pytest.raises(CamshaftError, match=message):
                serve(**options)
    assert list((tmp_path / "tmp").iterdir()) == []
    (tmp_path / "t mp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t mp"))  # serve --engine deploys there: said as $TMPDIR
    with pytest.raises(CamshaftError, match=r"the temporary directory \(\$TMPDIR\) .* holds whitespace"):
        serve(**{**options, "engine": engine, "repo": None, "http_port": 0})
    assert list((tmp_path / "t mp").iterdir()) == []


def test_a_read_only_tmp_is_said_before_tritonserver_starts(engine, tmp_path, monkeypatch):
    import tempfile

    made = tempfile.TemporaryDirectory

    def read_only_tmp(*args, dir=None, **kwargs):  # noqa: A002 (tempfile's name)
        if dir == "/tmp":  # a container's read-only root filesystem
            raise OSError(30, "Read-only file system")
        return made(*args, dir=dir, **kwargs)

    repo = deploy_repository(engine, tmp_path / "repo")
    monkeypatch.setattr(tempfile, "TemporaryDirectory", read_only_tmp)
    with pytest.raises(CamshaftError, match=r"/tmp is not writable \(Read-only file system\), and Triton's python "
                                            r"backend makes its directories there whatever \$TMPDIR says"):
        TritonServer(repo)


@pytest.mark.parametrize("host, message", [
    ("::1", "--host ::1: tritonserver takes IPv4 addresses here"),
    ("no-such-host.invalid", "--host no-such-host.invalid is no address of this machine"),
    ("10.255.255.1", "cannot listen on 10.255.255.1 port .* pass an address of this machine"),
])
def test_an_address_tritonserver_cannot_listen_on_is_said_as_it_is(host, message):
    from camshaft.triton_repo.launch import check_port

    with pytest.raises(CamshaftError, match=message):
        check_port(host, free_port("127.0.0.1"))


def test_picked_ports_differ_even_where_the_system_hands_a_freed_port_out_again(engine, tmp_path, monkeypatch):
    """tritonserver refused to start (seen in CI: HTTP and metrics "at the same address and port") when the ports,
    each picked by binding port 0 and closing, came back equal; here binding port 0 takes the lowest free port, as
    a system that reuses a freed port at once would."""
    import socket

    base = free_port("127.0.0.1")
    bind = socket.socket.bind

    def lowest_free(self, address):
        if address[1] != 0:
            return bind(self, address)
        for port in range(base, base + 50):
            with contextlib.suppress(OSError):
                return bind(self, (address[0], port))
        raise OSError("no free port near the test's")

    repo = deploy_repository(engine, tmp_path / "repo")
    monkeypatch.setattr(socket.socket, "bind", lowest_free)
    for given in ({}, {"grpc_port": base}, {"http_port": base + 1}):
        ends = TritonServer(repo, **given).endpoints
        ports = [ends.http_port, ends.grpc_port, ends.metrics_port]
        assert len(set(ports)) == 3, (given, ports)
        for name, port in given.items():
            assert getattr(ends, name) == port
    assert len({*vars(TritonServer(repo, http_port=None).endpoints).values()}) == 4  # None is 0, as it was


def test_a_stopped_batch_loop_is_unavailable_and_says_restart(engine):
    llm = LLM(engine, spin_wait=False, max_queue=4)
    llm.close()
    with pytest.raises(ServerClosedError) as closed:
        llm.submit([5, 6], SamplingParams(max_tokens=2), lambda output: None)
    code, message = error_status(closed.value)
    assert code == "UNAVAILABLE" and "restart the server" in message, (type(closed.value), message)
    with pytest.raises(RequestError) as bad:
        llm.submit([5, 6], SamplingParams(max_tokens=10_000), lambda output: None)
    assert error_status(bad.value)[0] == "INVALID_ARG"


def test_stop_ends_the_stubs_even_after_tritonserver_died(engine, tmp_path):
    import os

    import psutil

    from camshaft.triton_repo.channel import channel_path

    log = tmp_path / "tritonserver.log"
    server = TritonServer(deploy_repository(engine, tmp_path / "repo"), log_file=log, log_level="warning").start()
    logged = log.read_text()
    assert not [line for line in logged.splitlines() if line.startswith("I")]  # no info lines (I1207 ...)
    assert "DCGM" not in logged and "pinned" not in logged  # no GPU metrics nor pinned memory tried without a driver
    pid = server.process.pid
    stubs = [p for p in psutil.process_iter() if p.pid != pid and _pgid(p.pid) == pid]
    regions = server.shm_regions
    socket = channel_path("tensorrt_llm", pid)
    assert stubs and regions and socket.exists()
    os.kill(pid, signal.SIGKILL)  # a crash: the stubs now belong to init, not to tritonserver
    server.process.wait()
    server.stop()
    gone, alive = psutil.wait_procs(stubs, timeout=10)
    assert not alive, alive
    assert not [name for name in regions if Path("/dev/shm", name).exists()]
    assert not socket.parent.exists()  # the token model never finalized: stop() removes its socket directory


def test_a_port_in_use_is_refused_before_starting(engine, tmp_path):
    import socket

    from camshaft.triton_repo.server import TritonServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = TritonServer(deploy_repository(engine, tmp_path / "repo"), http_port=port)
        with pytest.raises(CamshaftError, match=f"port {port} on 127.0.0.1 is in use"):
            server.start()
        assert server.process is None


def _pgid(pid: int) -> int | None:
    import os

    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory) -> Path:
    """Requests of 4000 tokens: still running when a stop's exit timeout comes."""
    root = tmp_path_factory.mktemp("triton_long")
    model = make_tiny_model("llama", root / "hf", max_position_embeddings=4096)
    build_engine(BuildConfig(model, root / "engine", max_seq_len=4096, max_batch_size=2))
    return root / "engine"


def test_a_serve_killed_while_requests_run_takes_its_tritonserver_with_it(long_engine, tmp_path):
    """With nothing left to end the requests before Triton's exit timeout, Triton gave up on the models, crashed and
    hung (with its stubs and shared memory) for good. The token model now takes the dead launcher's part."""
    import os

    import psutil
    import tritonclient.grpc as grpcclient
    from test_triton import Stream, tensors

    from camshaft.triton_repo.server_exit import shm_regions

    serve, ports, lines = start_serve(long_engine, env={**os.environ, "TMPDIR": str(tmp_path)})
    triton, streams = [], []
    try:
        triton = [p for p in psutil.Process(serve.pid).children() if p.name() == "tritonserver"]
        group = [p for p in psutil.process_iter() if _pgid(p.pid) == triton[0].pid]
        long = dict(max_tokens=4000, min_tokens=4000, stream=True)
        streams = [Stream(f"127.0.0.1:{ports[1]}").send("ensemble", tensors(grpcclient, text_input="hi", **long)),
                   Stream(f"127.0.0.1:{ports[1]}").send("tensorrt_llm", tensors(
                       grpcclient, input_ids=[5, 6], request_output_len=4000, end_id=-1, streaming=True))]
        for stream in streams:
            stream.responses.get(timeout=60)  # both running
        regions = shm_regions(group)
        serve.kill()
        serve.wait()
        gone, alive = psutil.wait_procs(group, timeout=60)
        assert not alive, alive
        assert regions and not [name for name in regions if Path("/dev/shm", name).exists()]
    finally:
        for stream in streams:
            stream.close()
        for process in triton:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)


def test_a_serve_killed_while_a_client_keeps_its_stream_open_takes_its_tritonserver_with_it(engine, tmp_path):
    """A client's open gRPC stream keeps the text model it used loaded, after the token model (and its watch) has
    unloaded: that model's stub kills the orphaned server once it overstays its exit timeout."""
    import os

    import psutil
    import tritonclient.grpc as grpcclient
    from test_triton import Stream, tensors

    from camshaft.triton_repo.server_exit import shm_regions

    serve, ports, lines = start_serve(engine, env={**os.environ, "TMPDIR": str(tmp_path)})
    triton, stream = [], None
    try:
        triton = [p for p in psutil.Process(serve.pid).children() if p.name() == "tritonserver"]
        group = [p for p in psutil.process_iter() if _pgid(p.pid) == triton[0].pid]
        stream = Stream(f"127.0.0.1:{ports[1]}").send("ensemble", tensors(grpcclient, text_input="hi", max_tokens=2,
                                                                           stream=True))
        while not stream.responses.get(timeout=60)[0].get_response().parameters["triton_final_response"].bool_param:
            pass
        regions = shm_regions(group)
        serve.kill()
        serve.wait()
        gone, alive = psutil.wait_procs(group, timeout=60)  # 10 s exit timeout, then 15 s
        assert not alive, alive
        assert regions and not [name for name in regions if Path("/dev/shm", name).exists()]
    finally:
        if stream is not None:
            stream.close()
        for process in triton:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)


def test_a_server_started_from_a_worker_thread_outlives_it(engine, tmp_path):
    """The kernel's SIGTERM on the starter's death (PR_SET_PDEATHSIG) comes when the starting thread ends: a server
    started from a pool's thread stopped with it. Off the main thread, the models' watch of the process stands in."""
    from concurrent.futures import ThreadPoolExecutor

    repo = deploy_repository(engine, tmp_path / "repo")
    with ThreadPoolExecutor(1) as pool:
        server = pool.submit(lambda: TritonServer(repo).start()).result()
    try:
        time.sleep(2)
        assert server.is_ready() and server.process.poll() is None
    finally:
        server.stop()


def test_a_reload_of_the_token_model_is_refused_and_it_keeps_serving(engine, tmp_path):
    """Reloading tensorrt_llm through Triton's model control made a second executor, whose channel the first one's
    unload removed: the text models failed for good while the server said ready. Triton keeps a model whose reload
    fails (its documented behaviour), so the reload is refused."""
    import tritonclient.grpc as grpcclient
    from test_triton import Stream, tensors
    from tritonclient.utils import InferenceServerException

    class Explicit(TritonServer):
        def command(self) -> list[str]:
            return [*super().command(), "--model-control-mode=explicit", "--load-model=*"]

    server = Explicit(deploy_repository(engine, tmp_path / "repo")).start()
    try:
        control = grpcclient.InferenceServerClient(server.endpoints.grpc)  # an HTTP load's connection is inherited
        config = control.get_model_config("tensorrt_llm", as_json=True)["config"]  # by its stubs: it holds the exit
        with pytest.raises(InferenceServerException, match="tensorrt_llm is loaded in this tritonserver already"):
            control.load_model("tensorrt_llm", config=json.dumps(config))
        control.close()
        outputs, error, _ = Stream(server.endpoints.grpc).run("ensemble", tensors(
            grpcclient, text_input="hello", max_tokens=4))
        assert error is None and outputs
        metrics = requests.get(server.endpoints.metrics_url, timeout=30).text
        assert "camshaft_requests_total" in metrics
    finally:
        server.stop()  # after any model's failed reload, Triton 2.51's stop waits out its exit timeout (exit code 1)


def test_text_and_token_models_reloaded_onto_another_build_refuse_to_mix(engine, tmp_path):
    """Re-review: with engines/current flipped to another build, text models reloaded through model control ran the
    new tokenizer on the old executor (and a reloaded token model served text models loaded with the old build), in
    silence. The executor says which build it hosts on each connection: a text model's reload onto another build
    fails (Triton keeps the loaded one), and requests to one left on another build are refused saying to reload it."""
    import tritonclient.grpc as grpcclient
    from test_triton import Stream, tensors
    from tritonclient.utils import InferenceServerException

    class Explicit(TritonServer):
        def command(self) -> list[str]:
            return [*super().command(), "--model-control-mode=explicit", "--load-model=*"]

    other = tmp_path / "B"
    build_engine(BuildConfig(make_tiny_model("qwen2-bias", tmp_path / "hf"), other, max_seq_len=64,
                             max_num_tokens=64, max_batch_size=2))
    (tmp_path / "current").symlink_to(engine)
    server = Explicit(deploy_repository(tmp_path / "current", tmp_path / "repo"), exit_timeout_s=10).start()
    try:
        def ask() -> tuple:
            return Stream(server.endpoints.grpc).run("ensemble", tensors(grpcclient, text_input="hello",
                                                                         max_tokens=4))

        before, error, _ = ask()
        assert error is None and before
        (tmp_path / "current").unlink()
        (tmp_path / "current").symlink_to(other)
        control = grpcclient.InferenceServerClient(server.endpoints.grpc)
        with pytest.raises(InferenceServerException, match="model 'ensemble' would load the engine .*current.*: "
                                                           "load 'tensorrt_llm' onto it first"):
            control.load_model("ensemble")
        _, error, _ = ask()
        assert error is None  # the loaded one kept: the old build's tokenizer on the old build's executor
        control.unload_model("tensorrt_llm")
        deadline = time.monotonic() + 60
        while control.is_model_ready("tensorrt_llm") and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # its instance lock is released as its finalize ends
        control.load_model("tensorrt_llm")  # now on B
        control.close()
        _, error, _ = ask()
        assert error is not None and "reload 'ensemble' so both serve one engine" in str(error), error
    finally:
        server.stop()


def test_a_stop_lets_text_model_requests_in_flight_finish(long_engine, tmp_path):
    """SIGTERM while a text-model request streams over gRPC: Triton unloads the token model as soon as its own
    requests are done, but the text model's request (which reaches it over the channel) still finishes, every token,
    without an error."""
    import tritonclient.grpc as grpcclient
    from test_triton import Stream, tensors

    from camshaft.triton_repo.server import TritonServer

    with TritonServer(deploy_repository(long_engine, tmp_path / "repo"), exit_timeout_s=60) as server:
        stream = Stream(server.endpoints.grpc).send("ensemble", tensors(
            grpcclient, text_input="hello", max_tokens=4000, min_tokens=4000, stream=True,
            return_num_output_tokens=True))
        deadline = time.monotonic() + 120
        while stream.responses.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not stream.responses.empty(), "no response within 120 s"
        server.signal(signal.SIGTERM)
        outputs, error, _ = stream.collect()
    assert error is None
    assert int(outputs[-1]["num_output_tokens"].reshape(-1)[0]) == 4000


def test_a_repository_checks_its_engine_before_serving(engine, tmp_path):
    """An engine moved away failed all four models' loads, telling the user to rebuild; one rebuilt since the deploy
    ran with the old build's batch and queue sizes, silently. A symlinked engine path is kept, so a blue/green link
    flipped to another build is what a redeploy of the link serves."""
    from camshaft.triton_repo.deploy import check_deployed_engine
    from camshaft.triton_repo.serve import serve

    copy = tmp_path / "v1"
    shutil.copytree(engine, copy)
    (tmp_path / "current").symlink_to(copy)
    repo = deploy_repository(tmp_path / "current", tmp_path / "repo", name="llm", decoupled=False,
                             llm_options={"kv_cache_memory": 2**20})
    assert json.loads((repo / MARKER).read_text())["engine_dir"] == str(tmp_path / "current")
    assert check_deployed_engine(repo) is None
    from camshaft.errors import EngineError
    from camshaft.manifest import read_manifest

    with pytest.raises(EngineError, match=r"is a Triton model repository \(camshaft deploy\), not an engine; it serves "
                                          r".*current: pass that engine directory"):
        read_manifest(repo)  # camshaft run --engine REPO
    model = make_tiny_model("llama", tmp_path / "hf")
    build_engine(BuildConfig(model, copy, max_seq_len=128, max_batch_size=2))  # rebuilt in place: a new build id
    again = f"camshaft deploy --engine {tmp_path / 'current'} --repo {repo} --kv-cache-memory 1048576 --name llm " \
        "--no-decoupled"  # the deploy that wrote it, not the defaults
    assert "was rebuilt since" in check_deployed_engine(repo) and again in check_deployed_engine(repo)
    shutil.rmtree(copy)
    logged: list[str] = []
    with pytest.raises(CamshaftError, match=r"serves the engine .*current, which cannot be loaded .*deploy it again: "
                                            r"camshaft deploy --engine ENGINE --repo .* --name llm"):
        serve(engine=None, repo=repo, host="127.0.0.1", http_port=0, grpc_port=0, metrics_port=0, llm_options={},
              log=logged.append)
    assert not any("starting tritonserver" in line for line in logged)  # refused before the server started


def test_an_edited_repository_record_never_names_a_path_outside_it(engine, tmp_path):
    """The record's model name was joined to the repository unchecked and walked: "../.." listed the grandparent's
    files as the repository's (and "/" would walk the whole file system)."""
    from camshaft.triton_repo.deploy import _changed_files, _entries

    repo = deploy_repository(engine, tmp_path / "a" / "b" / "repo")
    record = json.loads((repo / MARKER).read_text())
    (repo / MARKER).write_text(json.dumps({**record, "name": "../.."}))
    assert "../.." not in _entries(repo)
    assert not [path for path in _changed_files(repo) if ".." in path], _changed_files(repo)


def test_a_config_pbtxt_pointed_at_another_engine_is_said_before_serving(engine, tmp_path):
    """serve --repo checked the engine the deploy record names while Triton loads the one config.pbtxt names."""
    from camshaft.triton_repo.deploy import TOKEN_MODEL, check_deployed_engine

    repo = deploy_repository(engine, tmp_path / "repo")
    assert check_deployed_engine(repo) is None
    config = repo / TOKEN_MODEL / "config.pbtxt"
    other = tmp_path / "other engine"
    config.write_text(config.read_text().replace(json.dumps(str(engine)), json.dumps(str(other))))
    warning = check_deployed_engine(repo)
    assert warning is not None and f"serves the engine {other}, not the {engine} camshaft deploy recorded" in warning


def test_a_failed_servers_log_tail_keeps_its_stubs_failures_and_leaves_out_the_no_gpu_error(engine, tmp_path):
    log = tmp_path / "tritonserver.log"
    log.write_text("\n".join([
        'E1207 19:33:36.631299 18852 server.cc:241] "CudaDriverHelper has not been initialized."',
        "| Model        | Version | Status |",
        "memory allocation of 2 bytes failed",  # a stub out of memory (Rust's allocator in the tokenizer)
        "RuntimeError: a bug in the loop",  # a traceback's last line
        'E1207 19:33:40.100000 18852 model_lifecycle.cc:654] "failed to load \'tensorrt_llm\'"',
        "I1207 19:33:40.200000 18852 server.cc:300] last", "I1207 19:33:40.300000 18852 server.cc:301] lines"]))
    tail = TritonServer(deploy_repository(engine, tmp_path / "repo"), log_file=log).log_tail(lines=2).splitlines()
    assert len(tail) == 5 and tail[:2] == ["memory allocation of 2 bytes failed", "RuntimeError: a bug in the loop"]
    assert "failed to load" in tail[2] and tail[3:] == log.read_text().splitlines()[-2:]


def test_a_stop_signal_or_a_failed_loop_is_found_anywhere_in_a_long_log(engine, tmp_path):
    """A debug log grows megabytes while models unload: "Signal (15) received." lay past the 4 KiB tail read."""
    from camshaft.triton_repo.server_exit import LOOP_FAILED

    log = tmp_path / "tritonserver.log"
    server = TritonServer(deploy_repository(engine, tmp_path / "repo"), log_file=log)
    log.write_text("I1207 start\n" + "x" * ((1 << 20) - 15) + "Signal (15) received.\n" + "I1207 verbose\n" * 300_000)
    assert server.signalled() and not server.loop_failed()
    with log.open("a") as more:
        more.write(f"E1207 python_be.cc] {LOOP_FAILED} (RuntimeError('bug'))\n" + "I1207 unloading\n" * 1000)
    assert server.loop_failed()


def test_a_served_name_ending_in_sync_still_streams(engine, tmp_path):
    """Review: the models' policy was read off the suffix, so `--name chat_sync` deployed its served model not
    decoupled ("chat_sync is not decoupled ...; send stream=true to the decoupled model chat_sync")."""
    repo = deploy_repository(engine, tmp_path / "repo", name="chat_sync")
    policy = {model: (repo / model / "config.pbtxt").read_text() for model in ("chat_sync", "chat_sync_sync")}
    assert "decoupled: true" in policy["chat_sync"] and "decoupled: false" in policy["chat_sync_sync"]


def test_models_copied_in_from_another_engines_repository_fail_to_load(engine, tmp_path):
    """Review: beta's models copied into alpha's repository loaded, and requests to beta ran on alpha's engine (its
    weights, beta's tokenizer) without a word; a text model now refuses to load beside another engine's token model."""
    other = tmp_path / "engine B"
    build_engine(BuildConfig(make_tiny_model("qwen2-bias", tmp_path / "hf"), other, max_seq_len=64, max_num_tokens=64,
                             max_batch_size=2))
    repo = deploy_repository(engine, tmp_path / "repo", name="alpha")
    beta = deploy_repository(other, tmp_path / "beta-repo", name="beta")
    for model in ("beta", "beta_sync"):
        shutil.copytree(beta / model, repo / model)
    with pytest.raises(CamshaftError) as refused:
        TritonServer(repo, ready_timeout_s=120).start()
    said = str(refused.value)
    assert "model 'beta' was deployed with the engine" in said and f"hosts {engine}" in said, said
