"""One error type for every bad input, and the small checks that raise it.

Every message names the argument, what was expected and what arrived, so a user can act on it:

    >>> from posenc.errors import PosencError, fail
    >>> try:
    ...     fail("factor", "a finite number > 0", -1.0)
    ... except PosencError as e:
    ...     print(e)
    factor: expected a finite number > 0, got -1.0
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NoReturn

import torch

__all__ = [
    "PosencError",
    "Raw",
    "fail",
    "check_positive",
    "check_int_positions",
    "batch_positions",
    "check_float_tensor",
]


class PosencError(ValueError):
    """Raised for any invalid input to posenc. A `ValueError`, so existing handlers still catch it."""


class Raw(str):
    """Text shown as-is after "got" (no quotes), e.g. `Raw("min -1")`."""


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, type):  # fail(arg, "...", type(x)) shows the type's name
        return value.__name__
    return repr(value)


def fail(arg: str, expected: str, got: Any) -> NoReturn:
    """Raise `PosencError` in the one format: `"<arg>: expected <expected>, got <got>"`.

    Args:
        arg: the argument's name as the caller wrote it (`"position_ids"`, `"config['rope_theta']"`).
        expected: what would have been accepted.
        got: what arrived; tensors show shape and dtype, types their name, `Raw` text as-is, the rest `repr`.
    Raises:
        PosencError: always.
    """
    raise PosencError(f"{arg}: expected {expected}, got {_show(got)}")


def check_positive(arg: str, value: Any, *, allow_zero: bool = False) -> float:
    """Return `value` as a float after checking it is a finite real number > 0 (>= 0 if allowed).

    Python and NumPy numbers are accepted; bools, strings, None and tensors are not.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(arg, "a real number", value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        fail(arg, "a finite number >= 0" if allow_zero else "a finite number > 0", value)
    return float(value)


def check_int_positions(arg: str, positions: Any, *, allow_negative: bool = False) -> torch.Tensor:
    """Check that `positions` is an integer tensor of logical positions (>= 0 unless allowed)."""
    if not isinstance(positions, torch.Tensor):
        fail(arg, "an integer torch.Tensor", type(positions))
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        fail(arg, "an integer dtype (int32 or int64) of logical positions", positions)
    # one host sync, at the API boundary: a negative position is a bug (left padding) unless asked for
    if not allow_negative and positions.numel() and bool((positions < 0).any()):
        fail(arg, "positions >= 0 (pass allow_negative=True to rotate backwards)", Raw(f"min {int(positions.min())}"))
    return positions


def batch_positions(arg: str, positions: Any, batch: int, tokens: int, *, allow_negative: bool = True) -> torch.Tensor:
    """Check `[t]` or `[b, t]` integer positions (b may be 1) and return them as int64 `[batch, tokens]`."""
    check_int_positions(arg, positions, allow_negative=allow_negative)
    if positions.ndim not in (1, 2) or positions.shape[-1] != tokens:
        fail(arg, f"shape [{tokens}] or [b, {tokens}]", positions)
    if positions.ndim == 2 and positions.shape[0] not in (1, batch):
        fail(arg, f"batch size 1 or {batch}", positions)
    return positions.long().reshape(-1, tokens).expand(batch, tokens).contiguous()  # [b, t]


def check_float_tensor(arg: str, x: Any, *, ndim: tuple[int, ...] | None = None) -> torch.Tensor:
    """Check that `x` is a floating-point tensor, optionally of one of the given ranks."""
    if not isinstance(x, torch.Tensor):
        fail(arg, "a floating-point torch.Tensor", type(x))
    if not x.dtype.is_floating_point:
        fail(arg, "a floating-point dtype (float32, bfloat16, float16 or float64)", x)
    if ndim is not None and x.ndim not in ndim:
        fail(arg, f"a tensor of rank {' or '.join(map(str, ndim))}", x)
    return x
