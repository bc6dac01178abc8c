"""The `camshaft` command line: a thin layer over the builder and runtime APIs."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from camshaft.errors import DISK_FULL, CamshaftError, RequestError
from camshaft.stop_signals import Stops

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
def _options(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Show camshaft's version and exit"),
    config: Path | None = typer.Option(
        None, "--config", metavar="FILE", dir_okay=False,
        help="Option values from a TOML file: a table per command (\\[build], \\[bench.throughput]) of its flags "
             "without the dashes (max-seq-len = 2048); flags on the command line win. Presets: configs/ in "
             "camshaft's source repository"),
) -> None:
    """Build, quantize, serve and benchmark LLM inference engines."""
    if config is not None:
        from camshaft.cli.config_file import read_defaults

        ctx.default_map = read_defaults(config, ctx.command)


CLEAR_TO_END = "\x1b[K"
_COUNTED = re.compile(r".*\b(?:layer|window|sample) (\d+)/(\d+)$")  # a step of a loop: the builders' over layers,
# eval's over windows, calibration's over samples


class _Line:
    open = False  # a layer step was last on the terminal, its line not ended (the next overwrites it)


_LINE = _Line()


def progress(message: str) -> None:
    """One line per message; a layer step (`... layer 3/30`) overwrites the previous one on a terminal and is shown
    at each quarter in a log."""
    counted = _COUNTED.match(message)
    if counted is None:
        _end_progress_line()
        err.print(f"[dim]·[/dim] {escape(message)}", soft_wrap=True)
        return
    done, total = int(counted.group(1)), int(counted.group(2))
    if err.is_terminal:  # the line-clearing escape written as it is: rich would style its "[" as markup
        err.print(f"[dim]·[/dim] {escape(message)}", end="", soft_wrap=True)
        err.file.write(CLEAR_TO_END + ("\n" if done >= total else "\r"))
        err.file.flush()
        _LINE.open = done < total
    elif done >= total or done % max(1, -(-total // 4)) == 0:
        err.print(f"[dim]·[/dim] {escape(message)}", soft_wrap=True)


@contextmanager
def flag_names(*names: str) -> Iterator[None]:
    """A RequestError raised inside names the flags the user typed (--max-batch-size), not the Python parameters
    (max_batch_size) the API it came from names."""
    try:
        yield
    except RequestError as exc:
        raise type(exc)(flagged(str(exc), *names), field=exc.field) from exc


def flagged(message: str, *names: str) -> str:
    """`message` with the Python parameter `names` in it written as the flags the user typed."""
    pattern = re.compile(r"(?<![-\w])(" + "|".join(map(re.escape, names)) + r")\b")
    message = pattern.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)
    return re.sub(r"(--[\w-]+) / \1\b", r"\1", message)  # "kv_cache_memory / --kv-cache-memory", rewritten


_MACHINE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.EMFILE,
                   errno.ENFILE, errno.ENOMEM, errno.ENAMETOOLONG, errno.EFBIG}


class _Terminated(SystemExit):
    """SIGTERM's exit: it unwinds like Ctrl-C, so half-written outputs are removed on the way out."""


def _end_progress_line() -> None:
    """A layer step's line left open is cleared before the next message (and nothing else is: a streamed reply's
    last line may be on the terminal too)."""
    if _LINE.open:
        err.file.write("\r" + CLEAR_TO_END)
        _LINE.open = False


def _terminated(signum: int, _frame: object) -> None:
    _end_progress_line()
    err.print("terminated")
    raise _Terminated(128 + signum)


def _stopped(exc: BaseException | None) -> int | None:
    """The exit code of the stop (Ctrl-C, SIGTERM) that `exc` unwinds from, whatever it became on the way: typer
    turns a KeyboardInterrupt into SystemExit(130), and a stop that lands inside an import surfaces as the import
    system's own error (a KeyError from its module locks)."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return 130
        if isinstance(exc, _Terminated):
            return int(exc.code)
        exc = exc.__cause__ or exc.__context__
    return None


def _cwd_exists() -> bool:
    try:
        os.getcwd()
    except FileNotFoundError:
        return False
    return True


def require_stdout() -> None:
    """A command whose output is on stdout refuses to run with stdout closed (`>&-`): its output would be lost."""
    if sys.stdout is None:
        raise CamshaftError("stdout is closed (>&-), so the output would be lost; redirect it (> FILE, or > /dev/null "
                            "to drop it)")


def pipe_closed() -> NoReturn:
    """stdout's reader went away (`| head`): exit quietly as a process SIGPIPE ends does (141), as coreutils do."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail again
    raise SystemExit(128 + signal.SIGPIPE)


def main() -> None:
    if sys.stdout is not None and hasattr(sys.stdout, "reconfigure"):  # a terminal that cannot show a character
        with contextlib.suppress(ValueError):  # (a Latin-1 locale, an emoji) shows "?" rather than a traceback
            sys.stdout.reconfigure(errors="replace")
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # docker stop, a scheduler's eviction, `timeout`
        stops = Stops()  # `timeout`'s second SIGTERM must not cut short the unwinding of its first

        def terminated(signum: int, frame: object) -> None:
            if stops.add(signum):
                _terminated(signum, frame)

        signal.signal(signal.SIGTERM, terminated)
    if not err.is_terminal:  # a log: transformers' bars (loading, saving) would be lines of carriage returns
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        app()
    except BaseException as exc:
        stop = _stopped(exc)
        _end_progress_line()
        if stop is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C would interrupt the exit with a traceback
            if stop == 130:
                err.print("interrupted")
            sys.exit(stop)
        if isinstance(exc, CamshaftError):
            from camshaft.cli.config_file import config_note

            said = str(exc) + config_note(str(exc), sys.argv[1:], typer.main.get_command(app))
            err.print(f"[bold red]error:[/bold red] {escape(said)}", soft_wrap=True)
            sys.exit(1)
        if isinstance(exc, SystemExit) and isinstance(exc.__context__, BrokenPipeError):  # click's exit 1 for it
            pipe_closed()
        if isinstance(exc, FileNotFoundError) and not _cwd_exists():  # a build or fetch into "." replaced it
            err.print("[bold red]error:[/bold red] the current directory no longer exists (deleted, or replaced by a "
                      "build or fetch into '.'); cd into it again if it was replaced (cd \"$PWD\"), or into another "
                      "directory", soft_wrap=True)
            sys.exit(1)
        if isinstance(exc, MemoryError):
            said = f" ({escape(str(exc))})" if str(exc) else ""
            err.print(f"[bold red]error:[/bold red] out of memory{said}: this machine's, or this process's limit "
                      "(ulimit -v, a container's), is too small for this work; free some memory, raise the limit, or "
                      "ask for less (build: a smaller --max-seq-len or --max-batch-size; run, serve, bench: a "
                      "smaller --kv-cache-memory)", soft_wrap=True)
            sys.exit(1)
        if isinstance(exc, OSError) and exc.errno in _MACHINE_ERRORS:  # the machine's, not ours: a full disk, ...
            writing = exc.errno in DISK_FULL  # with no file named: the output
            path = exc.filename2 or exc.filename  # a copy's: source, destination (where the space ran out)
            where = f": {path}" if path else " (writing the output)" if writing else ""
            hint = "; free some space there or choose another directory" if exc.errno == errno.ENOSPC and path else ""
            err.print(f"[bold red]error:[/bold red] {escape((exc.strerror or str(exc)) + where + hint)}",
                      soft_wrap=True)
            sys.exit(1)
        raise


# The command modules register themselves on the apps above.
from camshaft.cli import bench, build, inspect, run, serve  # noqa: E402, F401
