"""In-flight batching behind the real tritonserver under load: 64 concurrent gRPC streaming clients x 3 rounds with
mixed lengths, a quarter cancelling mid-stream; cancelled gRPC streams and a dropped HTTP stream abort their
requests; a full queue is refused as busy. One server on a tiny model for the module (the same load on SmolLM2:
test_triton_load_smollm2.py); state is read from its Prometheus metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import requests
from test_triton import (
    PROMPTS,
    Stack,
    Stream,
    assert_nothing_outlives,
    assert_same_ids,
    assert_same_text,
    batch_tensors,
    grpcclient,
    tensors,
    texts,
)

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.runtime.session import Session
from camshaft.triton_repo.deploy import deploy_repository
from camshaft.triton_repo.server import TritonServer

from tiny_models import make_tiny_model

# The queue leaves room beyond 64 clients: requests cancelled in one round may still be aborting when the next
# round's 64 arrive.
BATCH, QUEUE, CLIENTS, ROUNDS = 16, 64, 64, 3
# Tokens of a request that runs long enough to be cancelled while it generates: the tiny model makes ~5 tokens a ms,
# so 480 could finish before a cancellation (checked every 0.2 s) or a stop reached it on an idle machine.
LONG = 4000


@contextmanager
def serving(engine: Path, root: Path) -> Iterator[Stack]:
    repo = deploy_repository(engine, root / "repo", llm_options={"max_queue": QUEUE})
    session = Session(engine)
    try:
        with TritonServer(repo, log_file=root / "tritonserver.log") as server:  # kept for a failed run
            yield Stack(server, session)
    finally:
        session.engine.close()
    # Every test above ends with the executor idle (all requests finished or aborted, each with its final flag).
    # Triton then unloads the models and their stubs remove their memory, except in the python backend's known
    # shutdown hang (docs/triton.md, Troubleshooting; ~1 run in 10 of this module): stop() cleaned up after it.
    assert_nothing_outlives(server, repo)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton_load")
    model = make_tiny_model("llama", root / "hf", max_position_embeddings=4096)
    build_engine(BuildConfig(model, root / "engine", max_seq_len=4096, max_num_tokens=128, max_batch_size=BATCH))
    with serving(root / "engine", root) as stack:
        yield stack


def idle(values: dict[str, float]) -> bool:
    return (values["camshaft_num_requests_running"] == 0 and values["camshaft_num_requests_waiting"] == 0
            and values["camshaft_kv_cache_blocks_used"] == 0)


def trtllm_metrics(stack: Stack) -> tuple[dict[str, float], dict[str, float]]:
    """nv_trt_llm_request_metrics by request_type, nv_trt_llm_kv_cache_block_metrics by kv_cache_block_type."""
    text = requests.get(stack.server.endpoints.metrics_url, timeout=10).text
    found: dict[str, dict[str, float]] = {"request_type": {}, "kv_cache_block_type": {}}
    for label, family in (("request_type", "nv_trt_llm_request_metrics"),
                          ("kv_cache_block_type", "nv_trt_llm_kv_cache_block_metrics")):
        for match in re.finditer(rf'^{family}{{[^}}]*{label}="(\w+)"[^}}]*}} (\S+)$', text, re.MULTILINE):
            found[label][match[1]] = float(match[2])
    return found["request_type"], found["kv_cache_block_type"]


def client(stack: Stack, index: int, round_: int, prompts: list[str], lengths: tuple[int, ...]):
    """A text client (even index) or a token client (odd); every fourth cancels after two responses."""
    prompt = prompts[(index + round_) % len(prompts)]
    max_tokens = lengths[(index // 2 + round_) % len(lengths)]
    cancel_after = 2 if index % 4 == 3 else None
    if index % 2 == 0:
        inputs = tensors(grpcclient, text_input=prompt, max_tokens=max_tokens, stream=True)
        model = "ensemble"
    else:
        ids = stack.session.encode(prompt)
        inputs = tensors(grpcclient, input_ids=ids, input_lengths=len(ids), request_output_len=max_tokens,
                         streaming=True)
        model = "tensorrt_llm"
    outputs, error, cancelled = Stream(stack.server.endpoints.grpc).run(model, inputs, cancel_after)
    return model, prompt, max_tokens, outputs, error, cancelled


def run_load(stack: Stack, prompts: list[str], lengths: tuple[int, ...]) -> None:
    """CLIENTS concurrent streams x ROUNDS; every stream not cancelled equals its single-request output."""
    for prompt in prompts:
        for max_tokens in lengths:
            stack.reference(prompt, max_tokens)
    before = stack.metrics()
    completed = 0
    with ThreadPoolExecutor(CLIENTS) as pool:
        for round_ in range(ROUNDS):
            for model, prompt, max_tokens, outputs, error, cancelled in pool.map(
                    lambda i, r=round_: client(stack, i, r, prompts, lengths), range(CLIENTS)):
                assert error is None, f"{model} {prompt!r}: {error}"
                if cancelled:
                    continue
                reference = stack.reference(prompt, max_tokens)
                if model == "ensemble":
                    assert_same_text("".join(texts(outputs)), reference, stack.session.tokenizer)
                else:
                    ids = [t for o in outputs for t in o["output_ids"].reshape(-1).tolist()]
                    assert_same_ids(ids, reference, stack.session.engine.eos_token_ids)
                completed += 1
    assert completed >= CLIENTS * ROUNDS * 3 // 4
    # Triton's metrics are pushed every 0.2 s: an idle snapshot taken in a lull of the last round can still be the
    # latest when it ends, so wait for the count too (a lost request times out here)
    accepted = CLIENTS * ROUNDS
    after = stack.wait_metrics(
        lambda m: idle(m) and m["camshaft_requests_total"] - before["camshaft_requests_total"] == accepted,
        f"an idle executor with an empty KV pool after {accepted} accepted requests")
    assert after["camshaft_peak_batch_size"] > 1
    assert stack.server.is_ready()


def test_64_streaming_clients_three_rounds_with_cancellation(stack):
    run_load(stack, PROMPTS, (4, 12, 24, 40))


def long_text(stream: bool = True) -> dict:
    return {"text_input": "a", "max_tokens": LONG, "end_id": -1, "stream": stream}


def test_cancelled_grpc_streams_and_a_dropped_http_stream_abort_their_requests(stack):
    aborted = stack.metrics()["camshaft_requests_aborted_total"]
    grpc = stack.server.endpoints.grpc
    _, error, cancelled = Stream(grpc).run("ensemble", tensors(grpcclient, **long_text()), cancel_after=2)
    assert error is None and cancelled
    token_inputs = tensors(grpcclient, input_ids=[5, 6], request_output_len=LONG, end_id=-1, streaming=True)
    _, error, cancelled = Stream(grpc).run("tensorrt_llm", token_inputs, cancel_after=2)
    assert error is None and cancelled
    with requests.post(f"{stack.http}/ensemble/generate_stream", json=long_text(), stream=True, timeout=60) as sse:
        assert next(sse.iter_lines()).startswith(b"data: ")
    batch = batch_tensors(grpcclient, text_input=np.array([[b"a"], [b"b"]], np.object_),
                          max_tokens=np.array([[LONG]] * 2), end_id=np.array([[-1]] * 2), stream=np.array([[True]] * 2))
    _, error, cancelled = Stream(grpc).run("ensemble", batch, cancel_after=2)  # both prompts of the batch stop
    assert error is None and cancelled
    token_batch = batch_tensors(grpcclient, input_ids=np.array([[5, 6], [7, 8]]), input_lengths=np.array([[2]] * 2),
                                request_output_len=np.array([[LONG]] * 2), end_id=np.array([[-1]] * 2),
                                streaming=np.array([[True]] * 2))
    _, error, cancelled = Stream(grpc).run("tensorrt_llm", token_batch, cancel_after=2)
    assert error is None and cancelled
    # Triton 2.51 marks an HTTP stream cancelled when its client disconnects: all stop early (the text models count
    # each prompt of a batch as a request, the token model the whole batch as one)
    stack.wait_metrics(lambda m: m["camshaft_requests_aborted_total"] - aborted == 6, "six aborted requests")
    stack.wait_metrics(lambda m: m["camshaft_requests_total"] == m["camshaft_requests_finished_total"],
                       "every request counted as finished")
    stack.wait_metrics(idle, "an idle executor with an empty KV pool")


def test_stop_reaches_the_request_with_that_id_and_finished_ids_are_forgotten(stack):
    grpc = stack.server.endpoints.grpc
    short = [Stream(grpc).send("tensorrt_llm", tensors(grpcclient, input_ids=[5, 6], request_output_len=1),
                               request_id=f"id-{i}") for i in range(2 * BATCH)]
    assert all(s.collect()[1] is None for s in short)
    stack.wait_metrics(lambda m: idle(m) and m["camshaft_stoppable_requests"] == 0, "no request id left registered")
    running = Stream(grpc).send("tensorrt_llm", tensors(grpcclient, input_ids=[5, 6], request_output_len=LONG,
                                                        end_id=-1, streaming=True), request_id="id-3")
    # registered before it is submitted: its first token means the stop can find it (waiting for the 0.2 s metrics
    # instead let a loaded machine finish all its tokens first)
    _, first_error = running.responses.get(timeout=60)
    assert first_error is None
    _, error, _ = Stream(grpc).run("tensorrt_llm", tensors(grpcclient, stop=True), request_id="id-3")
    assert error is None
    outputs, error, _ = running.collect()
    assert error is None and outputs[-1]["finish_reason"].reshape(-1)[0] == b"abort"
    stack.wait_metrics(lambda m: idle(m) and m["camshaft_stoppable_requests"] == 0, "no request id left registered")
    # a batch of prompts in one request: the stop reaches every one of them
    running = Stream(grpc).send("tensorrt_llm", batch_tensors(
        grpcclient, input_ids=np.array([[5, 6, 7], [8, 9, 0]]), input_lengths=np.array([[3], [2]]),
        request_output_len=np.array([[LONG]] * 2), end_id=np.array([[-1]] * 2), streaming=np.array([[True]] * 2)),
        request_id="id-4")
    _, first_error = running.responses.get(timeout=60)
    assert first_error is None
    _, error, _ = Stream(grpc).run("tensorrt_llm", tensors(grpcclient, stop=True), request_id="id-4")
    assert error is None
    outputs, error, _ = running.collect()
    ends = {int(o["batch_index"].reshape(-1)[0]): o["finish_reason"].reshape(-1)[0] for o in outputs
            if "finish_reason" in o}
    assert error is None and ends == {0: b"abort", 1: b"abort"}, ends
    stack.wait_metrics(lambda m: idle(m) and m["camshaft_stoppable_requests"] == 0, "no request id left registered")


def test_a_full_queue_is_refused_as_busy_and_recovers(stack):
    refused = stack.metrics()["camshaft_requests_refused_total"]
    streams = [Stream(stack.server.endpoints.grpc).send("ensemble", tensors(grpcclient, **long_text()))
               for _ in range(BATCH + QUEUE)]
    try:
        full = stack.wait_metrics(
            lambda m: m["camshaft_num_requests_running"] + m["camshaft_num_requests_waiting"] == BATCH + QUEUE,
            f"{BATCH} running and {QUEUE} waiting requests")
        for _ in range(100):  # one scrape that caught no update half-way (the running requests grow their blocks)
            full, (requests_, blocks) = stack.metrics(), trtllm_metrics(stack)
            consistent = (requests_["waiting"] == full["camshaft_num_requests_waiting"]
                          and blocks["used"] == full["camshaft_kv_cache_blocks_used"])
            if consistent:
                break
        assert consistent, (full, requests_, blocks)
        assert requests_["max"] == BATCH and requests_["waiting"] > 0  # as an endpoint picker reads it
        assert requests_["scheduled"] == requests_["active"] == full["camshaft_num_requests_running"] > 0
        assert blocks["max"] == full["camshaft_kv_cache_blocks_total"] == blocks["used"] + blocks["free"]
        assert blocks["fraction"] == pytest.approx(blocks["used"] / blocks["max"]) and blocks["used"] > 0
        assert blocks["tokens_per"] == stack.session.engine.manifest.limits.kv_block_size
        busy = requests.post(f"{stack.http}/ensemble/generate", json=long_text(False) | {"max_tokens": 4},
                             timeout=60)
        # the model says UNAVAILABLE; Triton 2.51 answers 400 over HTTP (and INTERNAL over gRPC) all the same
        assert busy.status_code == 400 and "server busy" in busy.json()["error"], busy.text
        _, error, _ = Stream(stack.server.endpoints.grpc).run("ensemble", tensors(grpcclient, text_input="a",
                                                                                   max_tokens=4))
        # the text model holds as many requests as the executor admits: it refuses before reaching the executor
        assert error is not None and f"ensemble holds {BATCH + QUEUE} requests" in error.message(), error
        _, error, _ = Stream(stack.server.endpoints.grpc).run("tensorrt_llm", tensors(
            grpcclient, input_ids=[5, 6], request_output_len=4))
        assert error is not None and "server busy" in error.message()
        # the text model's two refusals count with the token model's one
        stack.wait_metrics(lambda m: m["camshaft_requests_refused_total"] - refused == 3, "three refusals counted")
    finally:
        for stream in streams:
            stream.cancel()
            stream.close()
    stack.wait_metrics(idle, "an idle executor with an empty KV pool")
    done = requests.post(f"{stack.http}/ensemble/generate", json={"text_input": "a", "max_tokens": 4}, timeout=60)
    assert done.status_code == 200 and stack.server.is_ready()
