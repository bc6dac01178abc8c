"""The default calibration corpus: the docstrings of a fixed list of standard-library modules and their public
members, in a fixed order. They are gathered by a Python of their own that loads the standard library alone
(`-I -S`), so what this process imported cannot change them (transformers adds methods to logging.Logger, torch
patches inspect.getfile): the same text on every run of the same Python version. Run as a script, this file prints
them as a JSON list; it imports nothing but the standard library."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import subprocess
import sys
import warnings

# English prose-heavy modules first; importing them has no side effects.
STDLIB_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "enum", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html.parser", "http.client", "inspect",
    "io", "ipaddress", "itertools", "json", "logging", "mailbox", "math", "mimetypes", "multiprocessing", "numbers",
    "operator", "optparse", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets",
    "selectors", "shlex", "shutil", "smtplib", "socket", "sqlite3", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "types", "typing",
    "unittest", "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "xml.etree.ElementTree",
    "zipfile", "zoneinfo",
)


@functools.cache
def stdlib_docstrings(min_chars: int = 40) -> tuple[str, ...]:
    """The docstrings, each once, gathered by a standard-library-only Python (this file run as a script)."""
    try:
        if not sys.executable:  # an embedded interpreter may not know its executable
            raise OSError("this interpreter's sys.executable is empty")
        run = subprocess.run([sys.executable, "-I", "-S", __file__, str(min_chars)], capture_output=True, text=True,
                             encoding="utf-8", check=False)
        failed = run.stderr.strip()[-300:] if run.returncode else None
    except OSError as exc:
        failed = str(exc)
    if failed is not None:
        from camshaft.quantize.spec import QuantizeError

        raise QuantizeError(f"gathering the built-in calibration corpus failed ({failed}); give your own text with "
                            "--calib-data")
    return tuple(json.loads(run.stdout))


def gather(min_chars: int) -> list[str]:
    with warnings.catch_warnings():  # e.g. typing.io's deprecation warning on attribute access
        warnings.simplefilter("ignore")
        return list(_docstrings(min_chars))


def _docstrings(min_chars: int):
    seen: set[str] = set()
    for module_name in STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a Python built without e.g. sqlite3
            continue
        objects = [module]
        for name in sorted(vars(module)):
            if name.startswith("_"):
                continue
            obj = getattr(module, name)
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj):
                objects.append(obj)
                objects.extend(v for m, v in sorted(vars(obj).items()) if not m.startswith("_"))
            elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                objects.append(obj)
        for obj in objects:
            doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
            if doc is None:
                continue
            doc = inspect.cleandoc(doc)
            if len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                yield doc


if __name__ == "__main__":
    json.dump(gather(int(sys.argv[1])), sys.stdout)
