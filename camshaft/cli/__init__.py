"""The `camshaft` command line: a thin layer over the builder and runtime APIs."""

from __future__ import annotations

import errno
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape

from camshaft.errors import CamshaftError, RequestError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
                  help="Build, quantize, serve and benchmark LLM inference engines.")
models_app = typer.Typer(no_args_is_help=True, help="Fetch known models as Hugging Face checkpoints.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks.")
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(no_args_is_help=True, help="Accuracy evaluation.")
app.add_typer(eval_app, name="eval")
err = Console(stderr=True)


def _version(show: bool) -> None:
    if show:
        from camshaft.version import __version__

        typer.echo(f"camshaft {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Show camshaft's version and exit")) -> None:
    """Build, quantize, serve and benchmark LLM inference engines."""


_COUNTED = re.compile(r".*\blayer (\d+)/(\d+)$")  # a step of the builders' loop over layers


def progress(message: str) -> None:
    """One line per message; a layer step (`... layer 3/30`) overwrites the previous one on a terminal and is shown
    at each quarter in a log."""
    counted = _COUNTED.match(message)
    if counted is None:
        err.print(f"[dim]·[/dim] {escape(message)}", soft_wrap=True)
        return
    done, total = int(counted.group(1)), int(counted.group(2))
    if err.is_terminal:
        err.print(f"[dim]·[/dim] {escape(message)}\x1b[K", end="\n" if done >= total else "\r", soft_wrap=True)
    elif done >= total or done % max(1, -(-total // 4)) == 0:
        err.print(f"[dim]·[/dim] {escape(message)}", soft_wrap=True)


@contextmanager
def flag_names(*names: str) -> Iterator[None]:
    """A RequestError raised inside names the flags the user typed (--max-batch-size), not the Python parameters
    (max_batch_size) the API it came from names."""
    pattern = re.compile(r"(?<![-\w])(" + "|".join(map(re.escape, names)) + r")\b")
    try:
        yield
    except RequestError as exc:
        message = pattern.sub(lambda m: "--" + m.group(1).replace("_", "-"), str(exc))
        message = re.sub(r"(--[\w-]+) / \1\b", r"\1", message)  # "kv_cache_memory / --kv-cache-memory", rewritten
        raise type(exc)(message) from exc


_MACHINE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.EMFILE,
                   errno.ENFILE, errno.ENOMEM, errno.ENAMETOOLONG}


def _terminated(signum: int, _frame: object) -> None:
    err.print("terminated")
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: half-written outputs are removed on the way out


def _from_ctrl_c(exc: BaseException | None) -> bool:
    """An exit that a KeyboardInterrupt caused (typer turns one into a silent SystemExit(130))."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def main() -> None:
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # docker stop, a scheduler's eviction, `timeout`
        signal.signal(signal.SIGTERM, _terminated)
    try:
        app()
    except CamshaftError as exc:
        err.print(f"[bold red]error:[/bold red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    except OSError as exc:  # the machine's, not ours: a full disk, a directory we may not write
        if exc.errno not in _MACHINE_ERRORS:
            raise
        where = f": {exc.filename}" if exc.filename else ""
        hint = "; free some space there or choose another directory" if exc.errno == errno.ENOSPC else ""
        err.print(f"[bold red]error:[/bold red] {escape((exc.strerror or str(exc)) + where + hint)}", soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except SystemExit as exc:
        if exc.code == 130 and _from_ctrl_c(exc):
            err.print("interrupted")
        raise


# The command modules register themselves on the apps above.
from camshaft.cli import bench, build, inspect, run, serve  # noqa: E402, F401
