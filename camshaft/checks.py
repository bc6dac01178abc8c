"""Value checks shared by every validated config: integers that are not bools (numpy integers count)."""

from __future__ import annotations

import numbers


def is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_int_at_least(value: object, least: int) -> bool:
    return is_int(value) and value >= least
