"""Output directories written atomically: never overwrite a foreign directory, build beside it, swap into place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def check_replaceable(output: Path, marker: str, kind: str, error: type[Exception]) -> None:
    """Refuse an output that exists and is neither empty nor a `kind` (recognised by its `marker` file)."""
    if output.exists() and not output.is_dir():
        raise error(f"--output {output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not (output / marker).exists():
        raise error(
            f"--output {output} is a non-empty directory that is not {kind}; refusing to overwrite it. "
            "Choose an empty or new directory."
        )


def staging_dir(output: Path) -> Path:
    """A fresh sibling of `output` to write into; `replace_dir` moves it into place."""
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def replace_dir(staging: Path, output: Path) -> None:
    old = output.parent / f".{output.name}.old-{os.getpid()}"
    if output.exists():
        os.replace(output, old)
    os.replace(staging, output)
    shutil.rmtree(old, ignore_errors=True)
