"""Output directories written atomically: never overwrite a foreign directory, build beside it, swap into place."""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import hashlib
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from camshaft.engine_files import write_atomic
from camshaft.errors import CamshaftError

_STAGING: set[Path] = set()  # the outputs this process's threads are writing now
_STAGING_LOCK = threading.Lock()
LONGEST_KEPT_NAME = 200  # .NAME.partial-PID and the like stay within the 255 characters of a file name
MOUNTINFO = Path("/proc/self/mountinfo")


def writable_dir(path: Path) -> bool:
    """A directory this process can create entries in, tried rather than asked (os.access says yes to root
    everywhere, /proc included). A full disk is raised as itself (the CLI says to free space), not as 'unwritable'."""
    if not path.is_dir():
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".camshaft-probe-", dir=path))
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR):  # ENOENT: /proc's
            return False
        raise
    return True


def unwritable(output: Path) -> str | None:
    """Why `output` cannot be written (its nearest existing ancestor, where it is built beside itself in a new
    sibling, is a file or not writable), or None."""
    parent = next((p for p in output.parents if p.exists()), output)
    if writable_dir(parent):
        return None
    what = ("is not a directory you can write to" if parent.is_dir() else "is a file" if parent.exists()
            else "no longer exists")
    return f"{parent} {what}"


def check_replaceable(output: Path, marker: str, kind: str, error: type[Exception], flag: str = "--output",
                      owned: Callable[[Path], set[str] | None] | None = None) -> None:
    """Refuse an output (given as `flag`) that exists and is neither empty nor a `kind` (recognised by its `marker`
    file, and by `owned` not saying None), or a `kind` holding entries other than those `owned` names (they would be
    deleted with it); a symlink or a mount point, which cannot be swapped for the new directory, is refused too, and
    so is a path under a file or in a directory this process cannot write."""
    output = Path(os.path.abspath(output))  # "." has a parent to build beside
    if why := unwritable(output):
        raise error(f"{flag} {output} cannot be written: {why}; choose a path in a writable directory")
    if output.is_symlink():
        raise error(f"{flag} {output} is a symlink (to {os.readlink(output)}); the output replaces it with a "
                    "directory: pass the directory itself, or a new path")
    if output.exists() and not output.is_dir():
        raise error(f"{flag} {output} exists and is not a directory")
    if output.is_dir() and mount_point(output):
        raise error(f"{flag} {output} is a mount point: the output is written beside it and moved into place, which "
                    "a mount point cannot take; pass a new directory inside it")
    ours = owned(output) if owned and (output / marker).exists() else set()
    if output.is_dir() and any(output.iterdir()) and (not (output / marker).exists() or ours is None):
        raise error(
            f"{flag} {output} is a non-empty directory that is not {kind}; refusing to overwrite it. "
            "Choose an empty or new directory."
        )
    foreign = sorted(set(os.listdir(output)) - ours) if owned and (output / marker).exists() else []
    if foreign:
        raise error(f"{flag} {output} is {kind} that also holds {', '.join(foreign[:5])}"
                    f"{' ...' if len(foreign) > 5 else ''}, which camshaft did not write and replacing it would "
                    "delete; move them out, or choose another directory")


def staging_dir(output: Path, flag: str = "--output", error: type[CamshaftError] = CamshaftError,
                advice: str = "choose a directory you can write to") -> Path:
    """A fresh sibling of `output` to write into; `replace_dir` moves it into place. Siblings left by runs that were
    killed (their process is gone) are removed first, but for a previous output that a run killed between
    `replace_dir`'s two moves left aside: it goes back in place. Writers use `staged`, which also removes it."""
    output = Path(os.path.abspath(output))
    hidden = _hidden(output)
    for stale in output.parent.glob(f"{glob.escape(hidden)}.*-*") if output.parent.is_dir() else ():
        kind, _, pid = stale.name.rpartition("-")  # this output's own: .NAME.partial-PID, .NAME.old-PID
        if kind in (f"{hidden}.partial", f"{hidden}.old") and pid.isdigit() and not _alive(int(pid)):
            if kind.endswith(".old") and _empty_or_missing(output):
                with contextlib.suppress(OSError):  # another run's output landed meanwhile: this one is left
                    if output.is_dir():
                        output.rmdir()
                    os.replace(stale, output)
            else:
                shutil.rmtree(stale, ignore_errors=True)
    for nested in output.parent.glob("..*.partial-*") if output.parent.is_dir() else ():
        pid = nested.name.rpartition("-")[2]  # a staging dir's own staging sibling (its process staged twice)
        staging = output.parent / f"{hidden}.partial-{pid}"
        if pid.isdigit() and nested.name == f"{_hidden(staging)}.partial-{pid}" and not _alive(int(pid)):
            shutil.rmtree(nested, ignore_errors=True)
    staging = _staging_path(output)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    except OSError as exc:
        raise error(f"cannot write beside {flag} {output} ({exc.strerror or exc}); {advice}") from exc
    return staging


@contextmanager
def staged(output: Path, flag: str = "--output", error: type[CamshaftError] = CamshaftError,
           advice: str = "choose a directory you can write to") -> Iterator[Path]:
    """`staging_dir` for a block that ends with `replace_dir`: whatever is left of the staging directory when the
    block ends is removed, after an error or a stop (Ctrl-C, SIGTERM) too, one landing as the directory is made
    included."""
    output = Path(os.path.abspath(output))  # now: an output over "." replaces the working directory
    key = Path(os.path.realpath(output.parent)) / output.name  # one staging sibling, however it is spelled
    with _STAGING_LOCK:  # a thread's staging sibling is its process's: a second one would remove the first's
        if key in _STAGING:
            raise error(f"{flag} {output} is being written by another thread of this process; wait for it to "
                        "finish, or write to another directory")
        _STAGING.add(key)
    try:
        yield staging_dir(output, flag, error, advice)
    finally:
        shutil.rmtree(_staging_path(output), ignore_errors=True)
        with _STAGING_LOCK:
            _STAGING.discard(key)


def _empty_or_missing(path: Path) -> bool:
    return not os.path.lexists(path) or (path.is_dir() and not path.is_symlink() and not any(path.iterdir()))


def _staging_path(output: Path) -> Path:
    return output.parent / f"{_hidden(output)}.partial-{os.getpid()}"


def _hidden(output: Path) -> str:
    """The start of the names of an output's siblings (.NAME.partial-PID, .NAME.old-PID): .NAME, or for a name
    near the filesystem's 255-byte limit, its start and a hash (the siblings' names would not fit)."""
    name, encoded = output.name, os.fsencode(output.name)
    if len(encoded) <= LONGEST_KEPT_NAME:
        return f".{name}"
    return f".{os.fsdecode(encoded[:LONGEST_KEPT_NAME - 13])}-{hashlib.sha256(encoded).hexdigest()[:12]}"


def mount_point(path: Path) -> bool:
    """A mount point, bind mounts within one filesystem included (os.path.ismount misses those)."""
    if os.path.ismount(path):
        return True
    try:
        table = MOUNTINFO.read_bytes()  # bytes: a mount's path need not be UTF-8
    except OSError:  # not Linux
        return False
    real = os.fsencode(os.path.realpath(path))
    unescape = functools.partial(re.sub, rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]))  # \040: a space
    return any(len(fields) > 4 and unescape(fields[4]) == real for fields in map(bytes.split, table.splitlines()))


def replace_dir(staging: Path, output: Path) -> None:
    """Move a finished staging directory into place, its files on disk first (after a power loss the output is the
    old one or the whole new one, never one whose files the page cache still held)."""
    output = Path(os.path.abspath(output))
    old = output.parent / f"{_hidden(output)}.old-{os.getpid()}"
    sync_tree(staging)
    try:
        if output.exists():
            os.replace(output, old)
        os.replace(staging, output)
    except OSError as exc:
        previous = ""
        if old.exists() and not output.exists():
            try:
                os.replace(old, output)
            except OSError:
                previous = f"; the previous output is in {old}"
        kept = Path(tempfile.mkdtemp(prefix=f"{_hidden(output)}.failed-", dir=output.parent))
        os.replace(staging, kept)  # not a .partial that the caller's cleanup or a later run removes
        raise CamshaftError(f"cannot move the finished output into {output} ({exc.strerror or exc}); it is complete "
                            f"in {kept}{previous}") from exc
    except BaseException:  # a stop (Ctrl-C, SIGTERM) between the two moves: the previous output goes back
        if old.exists() and not output.exists():
            os.replace(old, output)
        raise
    try:  # the move itself on disk; a parent this user may write but not read cannot be synced, and is not an error
        _fsync(output.parent)
    except OSError:
        pass
    shutil.rmtree(old, ignore_errors=True)


def sync_tree(root: Path) -> None:
    """fsync every regular file and directory under `root` (not symlinks, FIFOs or sockets)."""
    for folder, _, files in os.walk(root):
        for name in files:
            if stat.S_ISREG(os.lstat(os.path.join(folder, name)).st_mode):
                _fsync(Path(folder) / name)
        _fsync(Path(folder))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # a file system that cannot sync this (some cannot a directory) has nothing to lose here
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_user_file(path: Path, data: str | bytes) -> None:
    """A file the user named (results, a plot): /dev/stdout, /dev/fd/N and other /dev or /proc paths as given, after
    what this process printed (appended: not truncating a file stdout is redirected to); a symlink through to its
    target; in place where it is no regular file (a pipe); else whole or not at all (write_atomic), keeping the mode
    it had, or a new file's."""
    text = isinstance(data, str)
    given = Path(os.path.abspath(path))
    if given.parts[1:2] in (("dev",), ("proc",)):  # magic links: realpath of /dev/stdout may name no file
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        with open(given, "a" if text else "ab") as f:
            f.write(data)
        return
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with open(target, "w" if text else "wb") as f:
            f.write(data)
        return
    if target.exists():
        mode = stat.S_IMODE(target.stat().st_mode)
    else:
        mask = os.umask(0)
        os.umask(mask)
        mode = 0o666 & ~mask
    write_atomic(target, data, mode)
