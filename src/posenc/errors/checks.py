"""One error type for every bad input, and the small checks that raise it.

Every message names the argument, what was expected and what arrived, so a user can act on it:

    >>> from posenc.errors import PosencError, fail, integer, prefix
    >>> try:
    ...     fail("factor", "a finite number > 0", -1.0)
    ... except PosencError as e:
    ...     print(e)
    factor: expected a finite number > 0, got -1.0
    >>> try:
    ...     with prefix("config['rope_scaling']"):
    ...         integer("beta_fast", 2.5, min=1)
    ... except PosencError as e:
    ...     print(e, "|", e.arg)
    config['rope_scaling']['beta_fast']: expected a positive integer, got 2.5 | config['rope_scaling']['beta_fast']

Numbers are checked by kind, not by Python type: anything registered as `numbers.Integral` (Python and
NumPy integers) passes `integer`, anything `numbers.Real` passes `real`; `bool` passes neither.

This file holds those checks of Python values (`integer`, `real`, `boolean`, `choice`); `posenc.errors` is the
one import path for them and for the error itself (`base.py`) and the checks of tensors (`tensors.py`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .base import fail

__all__ = ["integer", "real", "boolean", "choice"]


def _num(v: Any) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))


def _bounds(lo: Any, lo_text: str, hi: Any, hi_text: str) -> str:
    lo, hi = (None if v is None else _num(v) for v in (lo, hi))
    if lo is not None and hi is not None:
        return f" in {'[' if lo_text == '>=' else '('}{lo}, {hi}{']' if hi_text == '<=' else ')'}"
    if lo is not None:
        return f" {lo_text} {lo}"
    return f" {hi_text} {hi}" if hi is not None else ""


def integer(arg: str, value: Any, *, min: int | None = None, max: int | None = None, what: str | None = None) -> int:
    """Return `value` as an `int` after checking it is an integer (not a bool) in `[min, max]`.

    Args:
        arg: the argument's name for the message.
        value: any `numbers.Integral` (Python or NumPy integer); floats, bools, strings, tensors fail.
        min, max: inclusive bounds, or None for none.
        what: the "expected" text, if the generated one ("a positive integer", "an integer in [2, 8]") is not enough.
    Raises:
        PosencError: `"<arg>: expected <what>, got <value>"`.
    """
    if what is None:
        what = "a positive integer" if min == 1 and max is None else "an integer" + _bounds(min, ">=", max, "<=")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(arg, what, value)
    if (min is not None and value < min) or (max is not None and value > max):
        fail(arg, what, value)
    if not _INT64_MIN <= value <= _INT64_MAX:  # every size, id and position ends up in an int64 tensor
        fail(arg, f"{what} that fits in int64 (|value| < 2**63)", value)
    return int(value)


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def real(arg: str, value: Any, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
         le: float | None = None, finite: bool = True, what: str | None = None) -> float:
    """Return `value` as a `float` after checking it is a real number (not a bool) within the bounds.

    Args:
        arg: the argument's name for the message.
        value: any `numbers.Real` (Python or NumPy number).
        gt, ge, lt, le: exclusive / inclusive lower and upper bounds, or None.
        finite: refuse nan and +-inf (default).
        what: the "expected" text, if the generated one ("a finite number > 0") is not enough.
    Raises:
        PosencError: `what`, or without it "a real number" for the wrong type and "a finite number > 0" (...)
            for a value out of bounds.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(arg, what or "a real number", value)
    lo, lo_text = (gt, ">") if gt is not None else (ge, ">=")
    hi, hi_text = (lt, "<") if lt is not None else (le, "<=")
    if what is None:
        what = ("a finite number" if finite else "a number") + _bounds(lo, lo_text, hi, hi_text)
    v = float(value)
    if (finite and not math.isfinite(v)) or math.isnan(v):
        fail(arg, what, value)
    if (gt is not None and not v > gt) or (ge is not None and not v >= ge):
        fail(arg, what, value)
    if (lt is not None and not v < lt) or (le is not None and not v <= le):
        fail(arg, what, value)
    return v


def boolean(arg: str, value: Any) -> bool:
    """Return `value` after checking it is `True` or `False` (a NumPy bool too; not 0/1)."""
    if not isinstance(value, (bool, np.bool_)):
        fail(arg, "True or False", value)
    return bool(value)


def choice(arg: str, value: Any, options: Sequence[Any]) -> Any:
    """Return `value` after checking it is one of `options` (`==`, but a bool never matches 1 nor a str 1)."""
    if not any(_same(value, o) for o in options):
        fail(arg, f"one of {tuple(options)!r}", value)
    return value


def _same(value: Any, option: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)) or isinstance(value, bool) != isinstance(option, bool):
        return False
    return isinstance(value, str) == isinstance(option, str) and value == option
