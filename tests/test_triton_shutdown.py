"""How `camshaft serve` ends a tritonserver that will not stop by itself: requests still running near the exit
timeout are ended through the token model's channel, and a server that overstays (or a second signal) is killed —
on real processes, no Triton needed."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from camshaft.errors import CamshaftError
from camshaft.triton_repo import shutdown
from camshaft.triton_repo.channel import ChannelServer
from camshaft.triton_repo.instance_lock import InstanceLock
from camshaft.triton_repo.server_exit import TRITON_EXIT_TIMEOUT_S, drain_s, exit_timeout_s

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def stubborn_process() -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "up\n"  # its SIGTERM handler is in place
    return process


def test_a_server_that_ignores_sigterm_is_killed_after_the_exit_timeout(monkeypatch):
    monkeypatch.setattr(shutdown, "KILL_AFTER_S", 0.5)
    drained, logged = [], []
    monkeypatch.setattr(shutdown, "drain", lambda pid: drained.append(pid) or False)
    process = stubborn_process()
    signals = [time.monotonic()]
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    code = shutdown.wait_until_stopped(process, signals, exit_timeout_s=1.0, log=logged.append)
    assert code == -signal.SIGKILL and 1.0 <= time.monotonic() - started < 10
    assert drained == [process.pid] and "did not exit" in logged[-1]


def test_a_server_that_said_it_gave_up_is_killed_soon_after(monkeypatch):
    """Triton 2.51 logs "Exit timeout expired. Exiting immediately" and may then hang (an open gRPC stream): no use
    waiting KILL_AFTER_S more."""
    monkeypatch.setattr(shutdown, "KILL_AFTER_S", 60.0)
    monkeypatch.setattr(shutdown, "drain", lambda pid: False)
    process, logged = stubborn_process(), []
    signals = [time.monotonic()]
    process.send_signal(signal.SIGTERM)
    code = shutdown.wait_until_stopped(process, signals, exit_timeout_s=1.0, log=logged.append, gave_up=lambda: True)
    assert code == -signal.SIGKILL and time.monotonic() - signals[0] < 30
    assert logged[-1].startswith("tritonserver gave up unloading at its exit timeout but did not exit")


def test_a_second_signal_kills_at_once():
    process = stubborn_process()
    logged: list[str] = []
    signals = [time.monotonic()]
    threading.Timer(0.3, lambda: signals.append(time.monotonic())).start()
    started = time.monotonic()
    assert shutdown.wait_until_stopped(process, signals, exit_timeout_s=30.0, log=logged.append) == -signal.SIGKILL
    assert time.monotonic() - started < 5 and "second signal" in logged[-1]


def test_a_lost_model_process_stops_serving_at_once_unless_the_server_was_signalled():
    """A stub gone while Triton runs on: said at once (Triton stays ready, every request fails); gone because
    something else stopped the server: its exit is awaited, and the caller says how it exited."""
    process = stubborn_process()
    started = time.monotonic()
    with pytest.raises(CamshaftError, match="the process serving the model.s. tensorrt_llm died"):
        shutdown.wait_until_stopped(process, [], exit_timeout_s=30.0, log=print, lost=lambda: "tensorrt_llm")
    assert time.monotonic() - started < 2
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    assert shutdown.wait_until_stopped(exiting, [], exit_timeout_s=30.0, log=print, lost=lambda: "tensorrt_llm",
                                       signalled=lambda: True) == 0
    process.kill()
    process.wait()


def test_a_terminal_hangups_second_sighup_is_the_same_stop():
    from camshaft.stop_signals import Stops

    stops = Stops()
    assert stops.add(signal.SIGHUP) and not stops.add(signal.SIGHUP)  # a closed terminal may send two at once
    assert stops.add(signal.SIGINT) and len(stops.times) == 2  # another signal is a second stop


def test_the_drain_message_reaches_the_token_model(tmp_path, monkeypatch):
    drained = threading.Event()
    path = tmp_path / "sockets" / "tensorrt_llm.sock"
    server = ChannelServer(path, lambda send, calls: [[] for _ in calls], lambda request_id: None, drain=drained.set)
    monkeypatch.setattr(shutdown, "channel_path", lambda model, pid: path)
    try:
        assert shutdown.drain(12345)
        assert drained.wait(10)
    finally:
        server.close()
    assert not shutdown.drain(12345)  # nothing listens any more


@pytest.mark.parametrize("args, timeout", [(["--exit-timeout-secs=7"], 7.0), (["--exit-timeout-secs", "9"], 9.0),
                                           ([], TRITON_EXIT_TIMEOUT_S), (["--exit-timeout-secs=x"], 30.0),
                                           (["--exit-timeout-secs=40", "--exit-timeout-secs=7"], 7.0),  # the last
                                           (["--exit-timeout=6"], 6.0), (["--exit-on-error=true"], 30.0),  # getopt
                                           (["--exit-timeout-secs=4s"], 4.0), (["--exit-timeout-secs=0x10"], 0.0)])
def test_the_token_model_reads_the_servers_exit_timeout_from_its_command_line(args, timeout):
    """A stopping server gives up on its models at its exit timeout (and crashes with them loaded): the token model
    ends the requests still running before then, however the server was started."""
    process = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)", *args],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "up\n"
        assert exit_timeout_s(process.pid) == timeout and drain_s(process.pid) == max(0.0, timeout - 3.0)
    finally:
        process.kill()
        process.wait()


def test_one_token_model_instance_per_server(tmp_path):
    """A reload through Triton's model control made a second instance whose channel the first one's unload then
    removed (every text request failed while the server said ready), and two instances of an instance_group started
    together: refused while one serves (Triton keeps it); while one drains (unload, then load) the next waits."""
    path = tmp_path / "channel" / "tensorrt_llm.sock"
    first = InstanceLock(path, "tensorrt_llm", wait_s=5)
    with pytest.raises(CamshaftError, match="loaded in this tritonserver already.*instance_group count 1"):
        InstanceLock(path, "tensorrt_llm", wait_s=5)
    first.draining()
    with pytest.raises(CamshaftError, match="last instance is still unloading"):
        InstanceLock(path, "tensorrt_llm", wait_s=0.3)
    taken = []
    waiter = threading.Thread(target=lambda: taken.append(InstanceLock(path, "tensorrt_llm", wait_s=10)))
    waiter.start()
    time.sleep(0.5)
    assert not taken
    first.release()
    waiter.join(10)
    assert taken  # the file the first one held was unlinked: the waiter took a new one
    with pytest.raises(CamshaftError, match="loaded in this tritonserver already"):
        InstanceLock(path, "tensorrt_llm", wait_s=5)
    taken[0].release()
    assert not path.parent.exists()
