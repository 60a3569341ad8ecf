"""Argument checks that fail early with the bad value, what was expected and how to fix it."""
from __future__ import annotations

from numbers import Integral, Real


def expect_int(name: str, value, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__}): "
                        f"set it to a whole number, e.g. {name}=32")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def expect_float(name: str, value, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}): "
                        f"set it to a number, e.g. {name}=0.1")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must lie in [{minimum}, {maximum}], got {value}")
    return float(value)
