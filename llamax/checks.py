"""Argument checks of the public API: integers, sequence ids and positions.

Every id, position, count and size the user passes goes through one of these before anything
changes: a float, a string or a bool is a TypeError (Python ints and numpy integers are welcome),
a value outside its range is a ValueError (or the error class the caller documents), never a
truncation and never a builtin OverflowError from the native layer.
"""
from __future__ import annotations

import operator
from typing import Any

import numpy as np

from llamax.dtypes import POS_MAX


def integer(value: Any, what: str) -> int:
    """value as a Python int: an int or a numpy integer (anything with __index__ but a bool).

    Raises:
        TypeError: value is a float, a bool, a string or anything else that is not an integer.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def in_range(value: Any, what: str, lo: int, hi: int, error: type[Exception] = ValueError) -> int:
    """integer(value) checked to lie in [lo, hi).

    Raises:
        TypeError: not an integer. error (ValueError by default): outside [lo, hi).
    """
    v = integer(value, what)
    if not lo <= v < hi:
        raise error(f"{what} = {v} is outside [{lo}, {hi})")
    return v


def seq_id(value: Any, n_seq_max: int, what: str = "seq_id", *, every: bool = False) -> int:
    """A sequence id in [0, n_seq_max); with every=True also -1 (every sequence)."""
    v = integer(value, what)
    if every and v == -1:
        return v
    if not 0 <= v < n_seq_max:
        extra = " (or -1 for every sequence)" if every else ""
        raise ValueError(f"{what} = {v} is outside [0, n_seq_max = {n_seq_max}){extra}")
    return v


def pos_bound(value: Any, what: str) -> int:
    """A bound of a position range [p0, p1) of the seq_* operations: negative means unbounded (p0
    from 0, p1 to the end), otherwise at most POS_MAX (positions lie in [0, POS_MAX)). Negative
    values map to -1.

    Raises:
        TypeError: not an integer. ValueError: above POS_MAX.
    """
    v = integer(value, what)
    if v < 0:
        return -1
    if v > POS_MAX:
        raise ValueError(f"{what} = {v} is beyond the largest position bound {POS_MAX} "
                         f"(positions lie in [0, {POS_MAX}); use -1 for 'to the end')")
    return v


def real(value: Any, what: str) -> float:
    """A finite real number (ints, floats and numpy scalars; not a bool).

    Raises:
        TypeError: not a number. ValueError: inf or nan.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not np.isfinite(v):
        raise ValueError(f"{what} = {v} is not finite")
    return v


def positive(value: Any, what: str, hi: int = 2**31) -> int:
    """An integer in [1, hi)."""
    return in_range(value, what, 1, hi)


__all__ = ["integer", "in_range", "seq_id", "pos_bound", "real", "positive"]
