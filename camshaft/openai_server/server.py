"""`camshaft serve --api openai`: the app on uvicorn (Ctrl-C / SIGTERM stop it cleanly)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from camshaft.errors import CamshaftError
from camshaft.openai_server.app import create_app
from camshaft.openai_server.log_writer import LogWriter
from camshaft.openai_server.stats_log import StatsLog
from camshaft.ports import listening_sockets, raise_open_files, url_host
from camshaft.runtime.engine_info import chat_template_problem
from camshaft.runtime.kv_cache import pool_bytes
from camshaft.runtime.llm import LLM
from camshaft.runtime.llm_options import check_serves_full_length
from camshaft.stop_signals import Stops

GRACEFUL_SHUTDOWN_S = 5  # open requests get this long to finish; then those left end as "server stopped" (a 503, or
FLUSH_S = 2  # a stream's error event and [DONE]), with this long to send that before uvicorn cuts what remains


def build_server(engine: Path, *, host: str, port: int, llm_options: dict, log_level: str = "info",
                 model_name: str | None = None, api_key: str | None = None,
                 tool_call_parser: str | None = None, chat_template: str | Path | None = None,
                 allowed_origins: tuple[str, ...] = ()) -> tuple[uvicorn.Server, LLM]:
    """The uvicorn server and the LLM it serves (the caller closes the LLM after the server stops). chat_template:
    a Jinja file or text in place of the engine tokenizer's."""
    log_like_uvicorn(log_level)
    llm = LLM(engine, spin_wait=False, chat_template=chat_template, **llm_options)
    try:
        check_serves_full_length(llm.engine.manifest, llm.config)  # a fraction's pool is known only now
        app = create_app(llm, model_name or served_name(engine), api_key, tool_call_parser, allowed_origins)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S + FLUSH_S, lifespan="off")
        return uvicorn.Server(config), llm
    except BaseException:
        llm.close()
        raise


def served_name(engine: Path) -> str:
    """The default model id: the engine directory's name as given (a symlink's, not its target's: engines/current
    stays `current` across rebuilds); `.` and a trailing slash name the directory, as the shell's $PWD names it."""
    here = os.environ.get("PWD", "")
    with contextlib.suppress(OSError):
        if os.path.isabs(here) and os.path.samefile(here, "."):  # getcwd() resolved the links the shell kept
            return Path(os.path.normpath(os.path.join(here, engine))).name
    return Path(os.path.abspath(engine)).name


def log_like_uvicorn(level: str) -> None:
    """camshaft's own log lines (an ignored field, a failed step) with a level, as uvicorn's beside them
    ("WARNING:  camshaft.openai_server.app: ..."); where the process configured logging itself, as it did."""
    import logging

    from uvicorn.logging import DefaultFormatter

    logger = logging.getLogger("camshaft")
    if logger.handlers or logging.getLogger().handlers:
        return
    try:
        handler: logging.Handler = LogWriter(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # a stderr that is no file (replaced in-process)
        handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())


def pool_line(llm: LLM) -> str:
    """What the KV pool holds, as vLLM says at start ("# blocks", the largest concurrency at full length)."""
    manifest = llm.engine.manifest
    limits, blocks = manifest.limits, llm.config.num_blocks - 1  # usable: block 0 is the null block
    size = pool_bytes(manifest, llm.config.num_blocks)
    held = llm.config.full_length_blocks
    window = ""
    if held < limits.max_blocks_per_seq:  # a sliding window frees what it passes
        window = f" (each holds its sliding window of {llm.config.sliding_window})"
    return (f"KV cache: {blocks} blocks of {limits.kv_block_size} tokens ({size / 2**30:.2f} GiB): "
            f"{blocks // held} sequences of {limits.max_seq_len} tokens at once{window}, more when shorter")


def serve(engine: Path, *, host: str, port: int, llm_options: dict, log: Callable[[str], None],
          model_name: str | None = None, api_key: str | None = None, tool_call_parser: str | None = None,
          chat_template: str | Path | None = None, log_level: str = "info",
          allowed_origins: tuple[str, ...] = ()) -> None:
    """Serve until Ctrl-C, SIGTERM or SIGHUP (a second one ends the requests still running at once, a third cuts
    the connections), then return; a batch loop that failed stops the server too, raising CamshaftError (exit 1, for
    a supervisor to restart it). uvicorn runs in a thread and this one handles the signals, so the LLM is closed
    and the exit status is 0. model_name: the model id clients send (default: the engine directory's name).
    log_level: debug, info (each request's end, with its id), warning or error: what camshaft and uvicorn log."""
    model_name = model_name or served_name(engine)
    raise_open_files()  # each connection is a file: the usual soft 1024 is reached by ~1000 clients
    sockets = listening_sockets(host, port)  # first: a port in use is refused before the engine loads
    try:
        server, llm = build_server(engine, host=host, port=port, llm_options=llm_options, model_name=model_name,
                                   api_key=api_key, tool_call_parser=tool_call_parser, chat_template=chat_template,
                                   log_level=log_level, allowed_origins=allowed_origins)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, name="camshaft-openai-http")

    stops = Stops()
    stats = StatsLog(llm, server.config.app.state.metrics, time.monotonic())
    stats_log = logging.getLogger("camshaft.openai_server")
    cutting = server.config.app.state.cutting

    def stop(signum: int, frame: object) -> None:
        if stops.add(signum):  # the second ends what runs at once; the third cuts the connections
            server.force_exit = len(stops.times) > 2
            server.should_exit = True

    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)  # nohup: ignored
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, *hangup)}
    died = False
    try:
        thread.start()
        announced = False
        while thread.is_alive():
            thread.join(0.2)
            times = stops.times
            if times and (len(times) > 1 or time.monotonic() - times[0] > GRACEFUL_SHUTDOWN_S) and llm.alive:
                cutting.set()
                llm.close()  # what still runs ends with ServerClosedError: each handler answers it in OpenAI's shape
            if llm.executor.failure is not None and not died:  # the batch loop failed: a supervisor restarts us
                died = server.should_exit = True
                log("error: the batch loop stopped (its traceback is above); stopping the server")
            if line := stats.line(time.monotonic()):
                stats_log.info(line)
            if server.started and not announced:
                announced = True
                log(f"OpenAI API for model {model_name!r} at http://{url_host(host)}:{port}/v1 "
                    f"(health: /health, metrics: /metrics{'; an API key required' if api_key else ''}); Ctrl-C "
                    "stops it")
                log(pool_line(llm))
                if chat_template is None and (problem := chat_template_problem(Path(engine))):
                    log(f"warning: the engine's chat template does not parse ({problem}): chat completions answer "
                        "500 until tokenizer/chat_template.jinja is fixed (or pass --chat-template)")
                if defaults := llm.engine.manifest.model.sampling_defaults:
                    log("requests that leave them out sample as the model's generation_config.json says: "
                        + ", ".join(f"{key}={value:g}" for key, value in defaults))
    finally:
        server.should_exit = True
        thread.join()
        for sock in sockets:
            sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        llm.close()
        for handler in logging.getLogger("camshaft").handlers:  # its lines before what the caller says next
            handler.flush()
    if not server.started:
        raise CamshaftError(f"the server could not start on {url_host(host)}:{port} (see the error above); "
                            "pick another --port or --host")
    if died:
        raise CamshaftError("the batch loop failed (see its traceback above); restart the server")
    log("stopped")
