"""Value checks shared by every validated config: integers that are not bools (numpy integers count)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """An integer, Python's or numpy's, that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_int_at_least(value: object, least: int) -> bool:
    return is_int(value) and value >= least


def check_positive_ints(owner: object, names: tuple[str, ...], error: type[Exception] = ValueError,
                        label: Callable[[str], str] = str) -> None:
    """Each named attribute of `owner` is an integer >= 1, else `error` naming it as `label(name)` says."""
    for name in names:
        value = getattr(owner, name)
        if not is_int_at_least(value, 1):
            raise error(f"{label(name)} must be a positive integer, not {value!r}")
