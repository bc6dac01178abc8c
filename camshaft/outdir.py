"""Output directories written atomically: never overwrite a foreign directory, build beside it, swap into place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from camshaft.errors import CamshaftError


def check_replaceable(output: Path, marker: str, kind: str, error: type[Exception], flag: str = "--output") -> None:
    """Refuse an output (given as `flag`) that exists and is neither empty nor a `kind` (recognised by its `marker`
    file)."""
    if output.exists() and not output.is_dir():
        raise error(f"{flag} {output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not (output / marker).exists():
        raise error(
            f"{flag} {output} is a non-empty directory that is not {kind}; refusing to overwrite it. "
            "Choose an empty or new directory."
        )


def staging_dir(output: Path, flag: str = "--output") -> Path:
    """A fresh sibling of `output` to write into; `replace_dir` moves it into place. Siblings left by runs that were
    killed (their process is gone) are removed first."""
    for stale in output.parent.glob(f".{output.name}.*-*") if output.parent.is_dir() else ():
        kind, _, pid = stale.name.rpartition("-")
        if kind.endswith((".partial", ".old")) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    except OSError as exc:
        raise CamshaftError(f"cannot write beside {flag} {output} ({exc.strerror or exc}); choose a directory you "
                            "can write to") from exc
    return staging


def replace_dir(staging: Path, output: Path) -> None:
    old = output.parent / f".{output.name}.old-{os.getpid()}"
    try:
        if output.exists():
            os.replace(output, old)
        os.replace(staging, output)
    except OSError as exc:
        raise CamshaftError(f"cannot move the finished output into {output} ({exc.strerror or exc}); it is complete "
                            f"in {staging}") from exc
    shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
