"""`camshaft serve --api openai` as a real process under load: 64 concurrent streaming chats, a quarter of whose
clients hang up mid-stream. Every other answer is whole and equals its single-request greedy output; the hung-up
requests are aborted (not run to the end) and their KV blocks freed; SIGTERM then stops the server cleanly."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_openai_server import HTTP, MODEL, metric, scrape, tiny_engine, wait_until

from camshaft.errors import CamshaftError
from camshaft.runtime.session import Session

NUM_CLIENTS, HANG_UP_EVERY = 64, 4
TOPICS = ["gears", "rivers", "stars", "bread", "maps", "ships", "bees", "clocks"]
CONVERSATIONS = [[{"role": "user", "content": f"Tell me about {topic}, part {part}."}]
                 for topic in TOPICS for part in (1, 2)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return tiny_engine(tmp_path_factory)


def _soft_open_files(soft: int):
    """A child's soft limit on open files set low (as a shell's `ulimit -Sn` would), its hard one kept."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return limit


@pytest.fixture(scope="module")
def server(engine_dir):
    """(process, base URL) of the CLI server; the last test stops it, this makes sure it is gone."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "from camshaft.cli import main; main()", "serve", "--api", "openai", "--engine",
         str(engine_dir), "--port", str(port), "--max-queue", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_soft_open_files(256))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(process, url), timeout=60)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _idle(url: str) -> bool:
    samples = scrape(url)
    return all(samples[f"camshaft_{name}"] == 0
               for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used"))


async def _chat(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int | None] | None:
    messages = CONVERSATIONS[i % len(CONVERSATIONS)]
    if i % HANG_UP_EVERY == HANG_UP_EVERY - 1:  # asks for far more than it reads, then hangs up
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2000, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        await stream.close()
        return None
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        usage = chunk.usage.completion_tokens if chunk.usage else usage
    return text, finish, usage


async def _load(url: str) -> list:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(_chat(client, i) for i in range(NUM_CLIENTS)))


def test_concurrent_streams_with_hang_ups(server, engine_dir):
    _, url = server
    session = Session(engine_dir)
    expected = [session.chat(messages, max_tokens=12, temperature=0) for messages in CONVERSATIONS]
    aborted_before = metric(url, 'camshaft_request_success_total{finished_reason="abort"}')

    results = asyncio.run(_load(url))

    for i, result in enumerate(results):
        if i % HANG_UP_EVERY == HANG_UP_EVERY - 1:
            assert result is None
            continue
        reference = expected[i % len(CONVERSATIONS)]
        assert result == (reference.text, reference.finish_reason, len(reference.token_ids)), f"client {i}"
    wait_until(lambda: _idle(url))  # the hung-up requests' KV blocks are free again
    hung_up = NUM_CLIENTS // HANG_UP_EVERY
    assert metric(url, 'camshaft_request_success_total{finished_reason="abort"}') == aborted_before + hung_up
    assert metric(url, "camshaft_prefix_cache_hit_blocks_total") > 0  # each conversation came four times


def test_a_non_streaming_client_that_hangs_up_is_aborted(server):
    _, url = server
    aborted_before = metric(url, 'camshaft_request_success_total{finished_reason="abort"}')
    body = json.dumps({"model": MODEL, "messages": CONVERSATIONS[0], "max_tokens": 2000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: metric(url, "camshaft_num_requests_running") == 1)  # then hang up, long before 2000
    wait_until(lambda: _idle(url))
    assert metric(url, 'camshaft_request_success_total{finished_reason="abort"}') == aborted_before + 1


def test_the_server_raises_its_soft_limit_on_open_files(server):
    """Review: at the usual soft limit of 1024 open files, a server past ~1000 connections hit EMFILE, and asyncio's
    accept loop logged tracebacks at megabytes a second; the server raises it toward the hard limit, as vLLM does."""
    import resource

    from camshaft.ports import OPEN_FILES

    process, _ = server
    limits = Path(f"/proc/{process.pid}/limits").read_text()
    soft, hard = re.search(r"Max open files\s+(\S+)\s+(\S+)", limits).groups()
    hard_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    wanted = OPEN_FILES if hard_limit == resource.RLIM_INFINITY else min(OPEN_FILES, hard_limit)
    assert int(soft) == max(256, wanted), limits  # the child started at 256


def test_healthy_after_load_then_sigterm_stops_cleanly(server, engine_dir):
    process, url = server
    assert HTTP.get(url + "/health").json() == {"status": "ok"}
    reference = Session(engine_dir).chat(CONVERSATIONS[5], max_tokens=8, temperature=0)
    out = HTTP.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CONVERSATIONS[5],
                                                         "max_tokens": 8, "temperature": 0}, timeout=60).json()
    assert out["choices"][0]["message"]["content"] == reference.text
    aborted = metric(url, 'camshaft_request_success_total{finished_reason="abort"}')
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr and "stopped" in stderr
    assert f"{out['id']}: finished (length) after " in stderr  # each request's end logged, with its id
    assert stderr.count(": aborted (the client went away) after ") == aborted > 0
    assert "KV cache: 2048 blocks of 32 tokens (" in stderr and "16 sequences of 4096 tokens at once" in stderr


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("long")
    model = make_tiny_model("llama", root / "hf", max_position_embeddings=32768)
    build_engine(BuildConfig(model, root / MODEL, max_seq_len=32768, max_num_tokens=256, max_batch_size=4))
    return root / MODEL


@pytest.mark.parametrize("stops", [["SIGTERM"], ["SIGINT", "SIGINT"], ["SIGHUP"]])
def test_requests_still_running_when_the_stop_window_ends_get_openais_error_shape(long_engine, stops):
    """SIGTERM gives open requests GRACEFUL_SHUTDOWN_S to finish; those still running then end as "server stopped":
    a stream's error event and [DONE], a 503 in OpenAI's shape (uvicorn cut streams mid-chunk and answered a plain
    "Internal Server Error", logging a traceback for each). A second Ctrl-C ends them so at once (it cut them, a
    traceback each); SIGHUP (a closed terminal) stops it the same way (it killed the server at once)."""
    port = _free_port()
    process = subprocess.Popen(  # SIGHUP as a terminal's session has it (a suite run under nohup ignores it)
        [sys.executable, "-c", "from camshaft.cli import main; main()", "serve", "--api", "openai", "--engine",
         str(long_engine), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "prompt": "a", "max_tokens": 30000, "ignore_eos": True}

    async def stream(client: httpx.AsyncClient) -> list[str]:
        async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
            return [line async for line in response.aiter_lines() if line.startswith("data:")]

    async def run() -> tuple[list[list[str]], httpx.Response, float]:
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.create_task(stream(client)) for _ in range(3)]
            whole = asyncio.create_task(client.post(url + "/v1/completions", json=body))
            while metric(url, "camshaft_num_requests_running") < 4:
                await asyncio.sleep(0.05)
            for i, name in enumerate(stops):
                await asyncio.sleep(1.5 * bool(i))  # a second one, not the same stop repeated
                process.send_signal(getattr(signal, name))
            began = time.monotonic()
            return await asyncio.gather(*tasks), await whole, time.monotonic() - began

    try:
        wait_until(lambda: _up(process, url), timeout=60)
        streams, whole, waited = asyncio.run(run())
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    for events in streams:
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][5:])["error"]["code"] == "server_stopped"
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "server_stopped"
    assert process.returncode == 0 and "Traceback" not in stderr and "stopped" in stderr
    assert (waited < 4) == (len(stops) > 1), waited  # the second stop did not wait out the 5 s window
    assert stderr.count("aborted (the server stopped)") == 4


def test_a_batch_loop_that_fails_stops_the_server_with_exit_1(engine_dir):
    """A bug in the batch loop fails what is in flight; the server then stops (exit 1) for a supervisor to restart
    it, its traceback logged once (it kept answering 503 and exited 0 when stopped)."""
    launcher = ("from camshaft.runtime import scheduler\n"
                "schedule = scheduler.Scheduler.schedule\n"
                "def broken(self):\n"
                "    if any(r.params.max_tokens == 7 for r in list(self.waiting)):\n"
                "        raise RuntimeError('a bug in the loop')\n"
                "    return schedule(self)\n"
                "scheduler.Scheduler.schedule = broken\n"
                "from camshaft.cli import main; main()\n")
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-c", launcher, "serve", "--api", "openai", "--engine",
                                str(engine_dir), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(process, url), timeout=60)
        failed = HTTP.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 7})
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert failed.status_code == 503 and "the batch loop failed" in failed.json()["error"]["message"]
    assert process.returncode == 1 and stderr.count("Traceback") == 1 and "Exception in thread" not in stderr
    assert stderr.rstrip().endswith("error: the batch loop failed (see its traceback above); restart the server")
    assert ": failed after " in stderr and "aborted" not in stderr  # a failure, not a stop's end of the request


def _up(process: subprocess.Popen, url: str) -> bool:
    assert process.poll() is None, process.communicate()[1]
    try:
        return HTTP.get(url + "/health").status_code == 200
    except httpx.TransportError:
        return False


def test_a_port_in_use_is_refused_before_the_engine_loads(engine_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-c", "from camshaft.cli import main; main()", "serve", "--api",
                               "openai", "--engine", str(engine_dir), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in done.stderr
    assert "KV cache" not in done.stderr and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


def test_the_openai_server_listens_on_every_address_its_host_names(monkeypatch):
    """localhost listed as ::1 and 127.0.0.1 (Debian, Fedora, containers) is served on both, as uvicorn bound a host
    name before the port was taken ahead of the engine; a second server on the port is refused there, not after
    its engine loaded (a bound socket that does not listen yet lets another bind the port too)."""
    import camshaft.ports as ports

    port = _free_port()
    first = ports.listening_sockets("127.0.0.1", port)
    try:
        with pytest.raises(CamshaftError, match=f"port {port} on 127.0.0.1 is in use"):
            ports.listening_sockets("127.0.0.1", port)
    finally:
        for sock in first:
            sock.close()
    real = socket.getaddrinfo

    def both(host, *args, **kwargs):
        return real("::1", *args, **kwargs) + real("127.0.0.1", *args, **kwargs) if host == "localhost" else \
            real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", both)
    port = _free_port()
    served = ports.listening_sockets("localhost", port)
    try:
        assert sorted(s.getsockname()[0] for s in served) == ["127.0.0.1", "::1"]
        for address in ("127.0.0.1", "::1"):
            with socket.create_connection((address, port), timeout=5):
                pass
    finally:
        for sock in served:
            sock.close()
    assert (ports.url_host("::1"), ports.url_host("127.0.0.1")) == ("[::1]", "127.0.0.1")


def test_a_stderr_nobody_reads_does_not_stall_the_server(engine_dir):
    """Each request's end is a log line: written by a thread of its own, so a full pipe (a supervisor that does not
    read it, a paused terminal) stalls neither requests nor the stop (request ~400 hung, and SIGTERM with it)."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-c", "from camshaft.cli import main; main()", "serve", "--api",
                                "openai", "--engine", str(engine_dir), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # never read until it exits
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(process, url), timeout=60)
        with httpx.Client(timeout=30) as client:
            for _ in range(1200):  # ~100 bytes of log each: twice a pipe's 64 KiB
                assert client.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
