"""Typed, strict access to a Hugging Face JSON config: a value of the wrong type or out of range is a CheckpointError
naming the field, never coerced (bool("false") is True)."""

from __future__ import annotations

import math
from typing import Any

from camshaft.checks import is_int
from camshaft.errors import CheckpointError

_REQUIRED = object()
_KINDS = {"int": "an integer", "number": "a finite number", "bool": "true or false"}


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past any float
        return False


def _shown(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


class Fields:
    """Typed access to one JSON object; `source` names it in errors."""

    def __init__(self, data: Any, source: str) -> None:
        if not isinstance(data, dict):
            raise CheckpointError(f"{source} must be a JSON object, not {data!r:.60}; restore it from the original "
                                  "checkpoint")
        self.data, self.source = data, source

    def get(self, key: str, kind: str, default: Any = _REQUIRED, *, least: float | None = None,
            most: float | None = None) -> Any:
        """The value of `key` (an absent key or null: `default`, or an error when required); a number as a float."""
        value = self.data.get(key)
        if value is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.source} lacks required field {key!r}")
            return default
        if kind == "int" and isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = {"int": is_int(value), "bool": isinstance(value, bool),
              "number": isinstance(value, int | float) and not isinstance(value, bool) and _finite(value)}[kind]
        if not ok or (least is not None and value < least) or (most is not None and value > most):
            bound = "".join(f" {op} {_shown(b)}" for op, b in ((">=", least), ("and <=", most)) if b is not None)
            raise CheckpointError(f"{self.source}: {key} must be {_KINDS[kind]}{bound}, not {value!r:.40}; restore "
                                  "it from the original checkpoint")
        return float(value) if kind == "number" else value
