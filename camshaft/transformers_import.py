"""transformers names its classes lazily, and its lazy module is not safe to import from several threads at first (a
thread's `from transformers import X` fails with "cannot import name X" while another's is under way). Every import of
it camshaft makes goes through from_transformers, under one lock: engines built or loaded from a thread pool."""

from __future__ import annotations

import importlib
import threading
from typing import Any

_LOCK = threading.RLock()


def from_transformers(*names: str, module: str = "transformers") -> Any:
    """`from module import names` (one name: the object; several: a tuple), under the lock."""
    with _LOCK:
        found = importlib.import_module(module)
        values = tuple(getattr(found, name) for name in names)
    return values[0] if len(values) == 1 else values
