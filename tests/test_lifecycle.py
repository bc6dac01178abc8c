"""The Python API as an application embeds it: an LLM dropped without close() frees its loop and engine, a failing
consumer cannot stop the loop, offline generate() is not bounded by a server's queue, a step may pack more tokens
than max_seq_len, and a closed Session says so."""

from __future__ import annotations

import gc
import queue
import threading
import time
import weakref

import pytest

from camshaft.errors import RequestError, ServerClosedError
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session

from tiny_models import fail_step, tiny_engine

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    """max_seq_len 32 under the default max_num_tokens (512): a step packs far more tokens than one sequence holds."""
    return tiny_engine(tmp_path_factory.mktemp("lifecycle"), max_seq_len=32, kv_block_size=8, max_batch_size=64)


def test_a_step_may_pack_more_tokens_than_max_seq_len(engine_dir):
    prompts = [[10 + i, 11, 12, 13, 14, 15, 16, 17, 18, 19] for i in range(40)]  # 400 prompt tokens in one step
    with LLM(engine_dir) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert max(s.num_tokens for s in llm.stats) > 32
    with Session(engine_dir) as session:
        assert [o.token_ids for o in outputs] == [session.generate(p, GREEDY).token_ids for p in prompts]


def test_an_llm_dropped_without_close_frees_its_loop_and_engine(engine_dir):
    llm = LLM(engine_dir)
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    thread, engine = llm.executor._thread, weakref.ref(llm.engine)
    del llm
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive() and engine() is None


def test_a_consumer_raising_system_exit_cannot_stop_the_loop(engine_dir):
    def fail(output):
        raise SystemExit("consumer gone")

    with LLM(engine_dir) as llm:
        llm.submit([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), fail)
        outputs = llm.generate([[8, 9, 10]], GREEDY, use_tqdm=False)  # the loop still runs
        assert len(outputs[0].token_ids) == 6 and llm.alive
        done: queue.SimpleQueue = queue.SimpleQueue()
        llm.submit([5, 6, 7], GREEDY, lambda o: o.finished and done.put(o))
        assert done.get(timeout=30).error is None


def test_n_outputs_held_for_a_first_sequence_that_fails_end_with_its_error(engine_dir):
    """n = 3: outputs 2 and 3 wait for the first's prompt blocks; when the first fails, they end with its error
    rather than run the failing prompt again each."""
    with LLM(engine_dir) as llm:
        vocab = llm.engine.manifest.model.vocab_size
        params = SamplingParams(n=3, max_tokens=4, temperature=0.7, bad_word_ids=[[i] for i in range(vocab)])
        finals: queue.SimpleQueue = queue.SimpleQueue()
        llm.submit([5, 6, 7], params, lambda o: o.finished and finals.put(o))
        outputs = [finals.get(timeout=30) for _ in range(3)]
        assert all("every token is banned" in str(o.error) for o in outputs)
        assert llm.executor.steps_done == 1  # the first's prompt only
        assert llm.executor.scheduler.blocks.num_used == 0


def test_offline_generate_is_not_bounded_by_a_servers_queue(engine_dir):
    with LLM(engine_dir, max_batch_size=2, max_queue=1) as llm:
        outputs = llm.generate([[20 + i, 21, 22] for i in range(8)], GREEDY, use_tqdm=False)
        assert [len(o.token_ids) for o in outputs] == [6] * 8


def test_a_closed_session_says_so(engine_dir):
    session = Session(engine_dir)
    stream = session.stream([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    next(stream)
    closer = threading.Thread(target=session.close)
    closer.start()
    closer.join()
    with pytest.raises(ServerClosedError, match="this Session is closed"):
        list(stream)  # closed while it ran: ends at its next token
    with pytest.raises(ServerClosedError, match="this Session is closed") as closed:
        session.generate([5, 6, 7], GREEDY)
    assert not isinstance(closed.value, RequestError)  # as a closed LLM: not bad input to skip


def test_a_failed_engine_step_is_logged_and_ends_only_its_requests(engine_dir, caplog):
    with LLM(engine_dir) as llm:
        fail_step(llm, at=1)
        done: queue.SimpleQueue = queue.SimpleQueue()
        with caplog.at_level("ERROR", logger="camshaft"):
            llm.submit([5, 6, 7], GREEDY, lambda o: o.finished and done.put(o))
            failed = done.get(timeout=30)
        assert isinstance(failed.error, RuntimeError) and "device lost" in str(failed.error)
        record = next(r for r in caplog.records if r.name == "camshaft.runtime.executor")
        assert "engine step failed; its 1 request(s)" in record.getMessage()
        logged = record.exc_info[1]  # the request's error is its own copy, with the step's traceback
        assert type(logged) is type(failed.error) and failed.error.__traceback__ is logged.__traceback__
        assert len(llm.generate([[8, 9, 10]], GREEDY, use_tqdm=False)[0].token_ids) == 6  # the loop carries on
        assert llm.alive
    assert not llm.alive


def test_a_second_close_on_another_thread_waits_for_the_loop_to_stop(engine_dir):
    """The finalizer runs once: a concurrent second close() returned while the first still stopped the loop, before
    the requests in flight were told (a server's drain and its unload race so)."""
    llm = LLM(engine_dir)
    step = llm.engine.step
    stepping = threading.Event()

    def slow(chunks):
        stepping.set()
        time.sleep(0.5)
        return step(chunks)

    llm.engine.step = slow
    finals: queue.SimpleQueue = queue.SimpleQueue()
    llm.submit([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), lambda o: o.finished and finals.put(o))
    assert stepping.wait(30)
    closing, close = threading.Event(), llm.executor.close

    def close_signalled() -> None:
        closing.set()
        close()

    llm.executor.close = close_signalled  # the first close is inside the finalizer when the second comes
    first = threading.Thread(target=llm.close)
    first.start()
    assert closing.wait(30)
    llm.close()
    assert not llm.executor._thread.is_alive() and isinstance(finals.get_nowait().error, ServerClosedError)
    first.join()


def test_every_stream_a_close_ends_raises_its_own_error(engine_dir):
    """One ServerClosedError went to every open stream: each consumer's raise added its frames to the same
    traceback (100 streams: 300 frames each, 15,000 lines if each was logged)."""
    import asyncio
    import traceback

    llm = LLM(engine_dir, max_batch_size=4)
    step = llm.engine.step
    llm.engine.step = lambda chunks: time.sleep(0.05) or step(chunks)

    async def consume(i: int) -> BaseException:
        try:
            async for _ in llm.stream([5, i + 3, 7], SamplingParams(max_tokens=25, ignore_eos=True)):
                pass
        except ServerClosedError as exc:
            return exc
        raise AssertionError("the stream ended without the close's error")

    async def main() -> list[BaseException]:
        tasks = [asyncio.create_task(consume(i)) for i in range(12)]
        await asyncio.sleep(0.1)
        await asyncio.to_thread(llm.close)
        return await asyncio.gather(*tasks)

    errors = asyncio.run(main())
    assert len({id(e) for e in errors}) == len(errors)
    assert all(sum(f.name == "consume" for f in traceback.extract_tb(e.__traceback__)) == 1 for e in errors)


def test_a_close_interrupted_while_it_waits_for_the_loop_closes_the_engine_when_called_again(engine_dir):
    """Ctrl-C in close()'s wait spent the finalizer: a second close() returned without ever closing the engine."""
    import _thread
    import signal

    llm = LLM(engine_dir)
    step, closed = llm.engine.step, []
    stepping = threading.Event()
    llm.engine.step = lambda chunks: stepping.set() or time.sleep(0.5) or step(chunks)
    backend_close = llm.engine.backend.close
    llm.engine.backend.close = lambda: closed.append(1) or backend_close()
    llm.submit([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), lambda output: None)
    assert stepping.wait(30)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background runner ignores SIGINT
    try:
        threading.Timer(0.1, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            llm.close()
    finally:
        signal.signal(signal.SIGINT, previous)
    llm.close()
    assert closed and not llm.executor._thread.is_alive()


def test_closing_from_a_sink_runs_no_step_on_the_closed_engine(engine_dir):
    llm = LLM(engine_dir)
    step = llm.engine.step
    llm.engine.step = lambda chunks: time.sleep(0.02) or step(chunks)  # B still runs when the abort comes
    finals: queue.SimpleQueue = queue.SimpleQueue()
    running = threading.Event()

    def close_when_aborted(output):
        if output.finished:
            llm.close()  # on the loop's thread, while it handles the abort

    first = llm.submit([5, 6, 7], SamplingParams(max_tokens=25, ignore_eos=True), close_when_aborted)[0]
    llm.submit([8, 9, 10], SamplingParams(max_tokens=25, ignore_eos=True),
               lambda o: running.set() if not o.finished else finals.put(o))
    assert running.wait(30)
    llm.abort(first)
    error = finals.get(timeout=30).error
    assert isinstance(error, ServerClosedError) and "closed before the request finished" in str(error), error
    llm.executor.join()


def test_a_stream_left_under_asyncio_run_is_aborted_without_warnings(engine_dir, caplog):
    import asyncio

    with LLM(engine_dir) as llm:
        async def first_delta() -> str:
            async for delta in llm.stream([5, 6, 7], SamplingParams(n=1, max_tokens=25, ignore_eos=True)):
                return delta

        with caplog.at_level("WARNING", logger="camshaft"):
            asyncio.run(first_delta())
            deadline = time.monotonic() + 30
            while llm.load().running and time.monotonic() < deadline:
                time.sleep(0.01)
        assert llm.load().running == 0 and llm.kv_cache.used == 0
        assert not [r for r in caplog.records if "failed taking an output" in r.getMessage()]


def test_waiting_for_the_loop_from_its_own_thread_is_refused_not_a_hang(engine_dir):
    """generate() inside a sink waited for the batch loop on the loop's thread: a silent, permanent hang."""
    caught: queue.SimpleQueue = queue.SimpleQueue()
    llm = LLM(engine_dir)

    def sink(output):
        if output.finished:
            for call in (lambda: llm.generate([5, 6], GREEDY), lambda: llm.stream_sync([5, 6], GREEDY)):
                try:
                    call()
                except RequestError as exc:
                    caught.put(str(exc))

    llm.submit([3, 4], GREEDY, sink)
    try:
        messages = [caught.get(timeout=30), caught.get(timeout=30)]
    except queue.Empty:  # the loop waits for itself: this LLM can never close, its daemon thread is left behind
        pytest.fail("generate() in a sink hung the batch loop")
    with llm:
        assert [m.split(" waits")[0] for m in messages] == ["generate()", "stream_sync()"]
        assert "this is the loop's thread (a sink)" in messages[0]
        assert llm.generate([5, 6], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_a_stream_whose_event_loop_closes_is_aborted(engine_dir):
    """An event loop closed by hand, its stream not closed: the request decoded on to max_tokens, read by no one."""
    import asyncio

    with LLM(engine_dir) as llm:
        step = llm.engine.step
        llm.engine.step = lambda chunks: (time.sleep(0.01), step(chunks))[1]
        loop = asyncio.new_event_loop()
        stream = llm.stream_outputs([3, 4], SamplingParams(max_tokens=28, ignore_eos=True))
        loop.run_until_complete(stream.__anext__())
        loop.close()
        deadline = time.monotonic() + 5
        while llm.load().running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.load().running == 0 and llm.executor.steps_done < 20  # aborted, not decoded to the end


def test_a_tokenizer_guided_decoding_cannot_read_raises_a_fresh_error_each_time(engine_dir, monkeypatch):
    """One stored exception raised again for every request grew its traceback (and the frames it holds) without
    bound in a long-running server."""
    import llguidance.hf

    from camshaft.runtime.guided import GuidedDecodingParams

    def unreadable(*args, **kwargs):
        raise ValueError("no byte tokens")

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", unreadable)
    with LLM(engine_dir) as llm:
        errors = []
        for _ in range(3):
            with pytest.raises(RequestError, match="guided decoding cannot read this engine's tokenizer") as refused:
                llm.generate([3, 4], SamplingParams(max_tokens=2, guided_decoding=GuidedDecodingParams(
                    choice=["a", "b"])), use_tqdm=False)
            errors.append(refused.value)
        assert len({id(e) for e in errors}) == 3


def test_a_close_racing_a_starting_request_still_releases_the_engine(engine_dir, monkeypatch):
    session = Session(engine_dir)
    check_open, closers = session._check_open, []

    def closed_meanwhile():
        if session._running.locked() and not closers:  # the request's own check: another thread's close() lands
            closers.append(threading.Thread(target=session.close))  # just before it
            closers[0].start()
            assert session._stopped.wait(30)
        check_open()

    monkeypatch.setattr(session, "_check_open", closed_meanwhile)
    with pytest.raises(ServerClosedError):
        session.generate([3, 4], GREEDY)
    closers[0].join(30)
    assert session.engine.session is None  # released, not left loaded until the Session is collected


def test_a_session_dropped_without_close_releases_its_engine(engine_dir):
    session = Session(engine_dir)
    session.generate([5, 6, 7], GREEDY)
    engine = session.engine
    del session
    gc.collect()
    assert engine.session is None  # its memory handed back, as close() does


EXIT_MID_REQUEST = """
import sys, threading
from camshaft import Session, SamplingParams
session = Session(sys.argv[1])
started = threading.Event()
def run():
    for _ in session.stream([5, 6, 7], SamplingParams(max_tokens=None, ignore_eos=True)):
        started.set()
    while True:
        for _ in session.stream([5, 6, 7], SamplingParams(max_tokens=None, ignore_eos=True)):
            pass
threading.Thread(target=run, daemon=True).start()  # a threaded server's request thread
started.wait(60)
"""


def test_a_process_exiting_while_a_daemon_thread_runs_a_session_request_exits_cleanly(engine_dir):
    import subprocess
    import sys

    for _ in range(3):  # ONNX Runtime aborts a process that exits inside a run: terminate called..., status 134
        done = subprocess.run([sys.executable, "-c", EXIT_MID_REQUEST, str(engine_dir)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


CLOSED_BY_A_SIGNAL_HANDLER = """
import os, signal, sys
from camshaft import SamplingParams, ServerClosedError, Session
session = Session(sys.argv[1])
signal.signal(signal.SIGINT, lambda *_: session.close())  # a worker's Ctrl-C / SIGTERM handler
feed = session.engine.feed
def feed_and_signal(*args, **kwargs):
    out = feed(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)  # the handler runs on this thread, inside the step
    return out
session.engine.feed = feed_and_signal
try:
    session.generate([5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))
except ServerClosedError:
    print("closed", session.engine.session is None)
"""

CLOSED_IN_A_FORKED_CHILD = """
import os, sys
from camshaft import SamplingParams, ServerClosedError, Session
session = Session(sys.argv[1])
session.generate([5, 6, 7], SamplingParams(max_tokens=2))
child = os.fork()
if child == 0:
    session.close()
    try:
        session.generate([5, 6, 7], SamplingParams(max_tokens=2))
        os._exit(1)
    except ServerClosedError:
        os._exit(0)
_, status = os.waitpid(child, 0)
after = session.generate([5, 6, 7], SamplingParams(max_tokens=2))
print("child", os.waitstatus_to_exitcode(status), len(after.token_ids))
"""


@pytest.mark.parametrize("script, expected", [(CLOSED_BY_A_SIGNAL_HANDLER, "closed True"),
                                              (CLOSED_IN_A_FORKED_CHILD, "child 0 2")])
def test_a_session_closed_from_a_signal_handler_or_a_forked_child_is_closed(engine_dir, script, expected):
    """The handler runs on the thread inside the step, which holds the step's lock (a deadlock); a forked child's
    close() marks its copy closed (the parent's engine is not the child's to release, and stays usable)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script, str(engine_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split("\n")[-2] == expected, done.stdout + done.stderr[-2000:]


def test_a_failed_batch_loop_fails_what_is_in_flight_and_says_what_ended_it(engine_dir, monkeypatch):
    """Servers watch Executor.failure to stop (the OpenAI server exits 1, Triton's token model ends its process)."""
    from camshaft.runtime import scheduler

    def broken(self):
        raise RuntimeError("a bug in the loop")

    with LLM(engine_dir) as llm:
        assert llm.executor.failure is None
        monkeypatch.setattr(scheduler.Scheduler, "schedule", broken)
        with pytest.raises(ServerClosedError, match=r"the batch loop failed: RuntimeError\('a bug in the loop'\)"):
            llm.generate([5, 6], SamplingParams(max_tokens=3))
        deadline = time.monotonic() + 10
        while llm.executor.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert repr(llm.executor.failure) == "RuntimeError('a bug in the loop')" and not llm.alive
    monkeypatch.undo()
    with LLM(engine_dir) as llm:
        llm.close()
        assert llm.executor.failure is None  # a close is no failure
