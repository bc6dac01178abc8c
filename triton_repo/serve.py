"""`camshaft serve` on Triton: an engine deployed to a temporary repository (or a repository), tritonserver started
on it, and its life until a stop signal: drained, stopped, its log kept when it failed."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

from camshaft.engine_files import deployed_record
from camshaft.errors import CamshaftError
from camshaft.ports import raise_open_files
from camshaft.stop_signals import Stops
from camshaft.triton_repo.launch import tritonserver_root
from camshaft.triton_repo.server import TritonServer
from camshaft.triton_repo.shutdown import drain, stub_watch, wait_until_stopped


def _text_model_name(repo: Path) -> str:
    name = (deployed_record(repo) or {}).get("name")
    return name if isinstance(name, str) else "ensemble"


def serve(*, engine: Path | None, repo: Path | None, host: str, http_port: int, grpc_port: int, metrics_port: int,
          llm_options: dict, log: Callable[[str], None], name: str | None = None, decoupled: bool = True,
          log_level: str = "info") -> None:
    """Serve a repository (or an engine deployed to a temporary one) until SIGINT/SIGTERM, then drain and exit.
    name, decoupled: as deploy_repository takes them, when deploying `engine` (a repository keeps its own).
    log_level: what tritonserver writes to its log file (TritonServer's)."""
    from camshaft.triton_repo.deploy import check_deployed_engine, check_path, deploy_repository

    tritonserver_root()  # not installed: said before anything is deployed
    raise_open_files()  # tritonserver inherits it: each of its connections is a file
    if repo is not None and (warning := check_deployed_engine(Path(repo))):
        log(f"warning: {warning}")
    if repo is not None and name is not None and name != _text_model_name(Path(repo)):
        raise CamshaftError(f"{repo} serves the text model {_text_model_name(Path(repo))!r}, not {name!r}; "
                            f"drop --name or redeploy with camshaft deploy --name {name}")
    if engine is not None:  # deployed there: said as what it is, not as a --repo never given
        check_path(Path(tempfile.gettempdir()), "the temporary directory ($TMPDIR)")
    with tempfile.TemporaryDirectory(prefix="camshaft-repo-") as tmp:
        if engine is not None:
            repo = deploy_repository(Path(engine), Path(tmp) / "repo", name=name or "ensemble",
                                     llm_options=llm_options, decoupled=decoupled)
            log(f"deployed {engine} to {repo}")
        elif given := [k for k, v in llm_options.items() if v is not None]:
            raise CamshaftError(f"{repo} serves the LLM options camshaft deploy wrote into it, so {', '.join(given)} "
                                "would be ignored; pass them to camshaft deploy instead")
        handle, log_path = tempfile.mkstemp(prefix="camshaft-tritonserver-", suffix=".log")  # kept if it fails
        os.close(handle)
        log_file = Path(log_path)
        try:
            server = TritonServer(Path(repo), host=host, http_port=http_port, grpc_port=grpc_port,
                                  metrics_port=metrics_port, exit_timeout_s=10, ready_timeout_s=600, log_file=log_file,
                                  log_level=log_level)
        except BaseException:
            log_file.unlink(missing_ok=True)
            raise
        log(f"starting tritonserver on {repo} (log: {server.log_file})")
        stops = Stops()
        stopping = stops.times  # when each stop signal came

        def forward(signum, _frame) -> None:
            if stops.add(signum) and len(stopping) == 1:
                log(f"got {signal.Signals(signum).name}: draining (up to {server.exit_timeout_s} s) and stopping; "
                    "a second one kills it")
                server.signal(signal.SIGTERM)

        hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)  # nohup: ignored
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, *hangup)}
        code = 0
        try:
            try:
                server.start()
            except CamshaftError:
                if stopping or server.process is None:  # interrupted while loading, or refused before it started
                    log_file.unlink(missing_ok=True)
                if stopping:
                    return
                raise
            lost = stub_watch(server.stubs())  # before "ready": a stub that dies once it is said is watched
            e = server.endpoints
            log(f"ready: HTTP http://{e.http}  gRPC {e.grpc}  metrics {e.metrics_url}")
            models = sorted(p.parent.name for p in Path(repo).glob("*/config.pbtxt"))
            text_model = _text_model_name(Path(repo))  # a repository of others' may have none of that name
            hint = f"; try POST http://{e.http}/v2/models/{text_model}/generate" if text_model in models else ""
            log(f"models: {', '.join(models)}{hint}")
            try:
                code = wait_until_stopped(server.process, stopping, server.exit_timeout_s, log, lost=lost,
                                          gave_up=server.gave_up, signalled=server.signalled)
            except CamshaftError as exc:  # a model's process died: its log says why
                drain(server.process.pid)  # the requests still running get their final error now, not at the cut
                raise CamshaftError(f"{exc}; its log ({log_file}) ends:\n{server.log_tail()}") from None
            if not stopping:  # something else stopped it (a SIGTERM sent to it), or it failed
                raise CamshaftError(f"tritonserver exited by itself with code {code}; its log ends:\n"
                                    f"{server.log_tail()}")
        finally:
            server.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
        if server.loop_failed():  # while it stopped: no clean stop, whatever the exit code
            raise CamshaftError(f"the batch loop failed (its log is kept: {log_file}); restart the server")
        if code:  # killed, or it failed while stopping: its log is what says why
            log(f"stopped (tritonserver exit code {code}; its log is kept: {log_file})")
            return
        log_file.unlink(missing_ok=True)
        log("stopped")
