"""The channel between the Triton text models and the executor the token model hosts (triton_repo/channel.py), over a
real Unix socket to a real LLM: streamed outputs equal Session's, abort and a closed connection free the request's
blocks, a refused request comes back as an error with its Triton code, and no listener is a clear error."""

from __future__ import annotations

import queue
import time

import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import ServerClosedError
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session
from camshaft.triton_repo.channel import ChannelClient, ChannelServer

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("channel")
    model = make_tiny_model("llama", root / "hf", max_position_embeddings=4096)
    build_engine(BuildConfig(model, root / "engine", max_seq_len=4096, max_num_tokens=64, max_batch_size=4))
    return root / "engine"


@pytest.fixture
def channel(engine_dir, tmp_path):
    """A channel server in front of an LLM (as the token model sets it up) and a client."""
    with LLM(engine_dir, max_queue=2) as llm:

        def submit(send, calls):  # as the token model: every prompt checked before any is queued
            return llm.submit_batch([(values["prompt"], SamplingParams(max_tokens=values["max_tokens"],
                                                                       ignore_eos=True), sink_for(send, call_id))
                                     for call_id, values in calls])

        def sink_for(send, call_id):
            def sink(output):
                reason = output.result.finish_reason if output.finished else None
                send(("out", call_id, {"ids": list(output.token_ids), "finish_reason": reason,
                                       "last": output.finished}))
            return sink

        server = ChannelServer(tmp_path / "private" / "executor.sock", submit, llm.abort)
        arrived: queue.Queue = queue.Queue()
        client = ChannelClient(server.path, arrived.put)
        try:
            yield llm, client, arrived
        finally:
            client.close()
            server.close()


def collect(arrived: queue.Queue, call_id: str) -> tuple[list[int], str]:
    ids = []
    while True:
        message = arrived.get(timeout=60)
        assert message[:2] == ("out", call_id), message
        ids += message[2]["ids"]
        if message[2]["finish_reason"] is not None:
            return ids, message[2]["finish_reason"]


def wait_idle(llm: LLM) -> None:
    deadline = time.monotonic() + 30
    while llm.load().running or llm.load().kv_blocks_used:
        assert time.monotonic() < deadline, f"the executor kept {llm.load()}"
        time.sleep(0.02)


def test_outputs_stream_back_equal_to_session(engine_dir, channel):
    llm, client, arrived = channel
    expected = Session(engine_dir).generate([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    client.send(("submit", "a", {"prompt": [5, 6, 7], "max_tokens": 20}))
    assert collect(arrived, "a") == (expected.token_ids, "length")
    wait_idle(llm)


def test_abort_and_a_closed_connection_free_the_request(channel):
    llm, client, arrived = channel
    client.send(("submit", "long", {"prompt": [5, 6], "max_tokens": 4000}))
    assert arrived.get(timeout=60)[:2] == ("out", "long")
    client.send(("abort", "long"))
    ids, reason = collect(arrived, "long")
    assert reason == "abort" and len(ids) < 4000
    wait_idle(llm)
    client.send(("submit", "gone", {"prompt": [5, 6], "max_tokens": 4000}))
    assert arrived.get(timeout=60)[:2] == ("out", "gone")
    steps = llm.executor.steps_done
    client.close()  # a text model that went away: the server aborts what it left running
    wait_idle(llm)
    assert llm.executor.steps_done - steps < 2000  # aborted, not run to its 4000 tokens (one step a token)


def test_a_refused_request_comes_back_as_an_error_with_its_code(channel):
    llm, client, arrived = channel
    client.send(("submit", "empty", {"prompt": [], "max_tokens": 4}))
    kind, call_id, code, message = arrived.get(timeout=60)
    assert (kind, call_id, code) == ("error", "empty", "INVALID_ARG") and "no tokens" in message
    running = [f"busy-{i}" for i in range(4 + 2)]  # the batch and the queue full
    for call_id in running:
        client.send(("submit", call_id, {"prompt": [5, 6], "max_tokens": 4000}))
    client.send(("submit", "one-too-many", {"prompt": [5, 6], "max_tokens": 4}))
    while (message := arrived.get(timeout=60))[1] != "one-too-many":
        pass
    assert message[0] == "error" and message[2] == "UNAVAILABLE" and "busy" in message[3], message
    for call_id in running:
        client.send(("abort", call_id))
    wait_idle(llm)


def test_a_batch_with_one_bad_prompt_runs_none_of_them(channel):
    """("submit_all", ...): every prompt is checked before any runs; the bad one's error names it, as a stock
    backend refuses the whole batch."""
    llm, client, arrived = channel
    steps = llm.executor.steps_done
    for bad in ({"prompt": [7, 8], "max_tokens": 0}, {"prompt": [7] * 4095, "max_tokens": 4}):  # params; too long
        client.send(("submit_all", "b0", [("b0", {"prompt": [5, 6], "max_tokens": 4}), ("b1", bad)]))
        kind, call_id, code, message = arrived.get(timeout=60)
        assert (kind, call_id, code) == ("error", "b0", "INVALID_ARG") and "request_output_len" in message, message
        assert llm.executor.steps_done == steps and llm.load().running == llm.load().waiting == 0
    client.send(("submit_all", "c0", [("c0", {"prompt": [5, 6], "max_tokens": 3}),
                                      ("c1", {"prompt": [7, 8], "max_tokens": 2})]))
    got = {}
    while len(got) < 2:
        message = arrived.get(timeout=60)
        if message[2]["last"]:
            got[message[1]] = message[2]["finish_reason"]
    assert got == {"c0": "length", "c1": "length"}
    wait_idle(llm)


def test_no_listener_is_a_clear_error(tmp_path):
    client = ChannelClient(tmp_path / "nobody.sock", lambda message: None, connect_timeout_s=0.3)
    with pytest.raises(ServerClosedError, match="no executor listens on .*nobody.sock"):
        client.send(("submit", "x", {}))


def test_a_token_model_that_went_away_fails_requests_at_once_not_after_the_load_wait(channel):
    """Before the first connection the client waits for the token model to load; once it was there, its going away
    (its process died) is said within a couple of seconds, not after a minute a request."""
    llm, client, arrived = channel
    client.send(("submit", "first", {"prompt": [5, 6], "max_tokens": 2}))
    collect(arrived, "first")
    client.connect_timeout_s = 600  # what a first connection may wait
    client.close()
    client.connection = None
    aside = client.path.rename(client.path.with_name("aside.sock"))  # the listener gone, as when its process dies
    started = time.monotonic()
    try:
        with pytest.raises(ServerClosedError, match=f"no executor listens on {client.path}: its token model is "
                                                     "gone"):
            client.send(("submit", "second", {"prompt": [5, 6], "max_tokens": 2}))
        assert time.monotonic() - started < 10
    finally:
        aside.rename(client.path)


def test_the_socket_path_fits_a_long_tmpdir(monkeypatch):
    import tempfile

    from camshaft.triton_repo.channel import SOCKET_PATH_MAX, channel_path

    monkeypatch.setattr(tempfile, "gettempdir", lambda: "/scratch/" + "job-1234567890" * 6)
    path = channel_path("tensorrt_llm")
    assert str(path).startswith("/tmp/camshaft-triton-") and len(str(path)) <= SOCKET_PATH_MAX
    monkeypatch.setattr(tempfile, "gettempdir", lambda: "/var/tmp")
    assert str(channel_path("tensorrt_llm")).startswith("/var/tmp/camshaft-triton-")
