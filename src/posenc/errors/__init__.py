"""One error type for every bad input, and the small checks that raise it: the one import path for all of them.

- `base.py`: `PosencError` (a `ValueError`), `Raw`, `fail`, `prefix`, `rename`: the error and its message format.
- `checks.py`: checks of Python values (`integer`, `real`, `boolean`, `choice`).
- `tensors.py`: checks of tensors (`positions`, `assert_values`, `integer_tensor`, `check_int_positions`,
  `batch_positions`, `check_float_tensor`), without a host sync where the caller asks for none.

    >>> from posenc.errors import PosencError, fail
    >>> try:
    ...     fail("factor", "a finite number > 0", -1.0)
    ... except PosencError as e:
    ...     print(e)
    factor: expected a finite number > 0, got -1.0
"""

from .base import PosencError, Raw, fail, prefix, rename
from .checks import boolean, choice, integer, real
from .tensors import (MAX_POSITION, assert_values, batch_positions, check_float_tensor, check_int_positions,
                      integer_tensor, positions, transformed)

__all__ = ["PosencError", "Raw", "fail", "prefix", "rename", "integer", "real", "boolean", "choice", "positions",
           "assert_values", "integer_tensor", "check_int_positions", "batch_positions", "check_float_tensor",
           "transformed", "MAX_POSITION"]
