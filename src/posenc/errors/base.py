"""The one error type, `PosencError`, and its one message format: `"<arg>: expected <expected>, got <got>"`.

Here: the error, `Raw` text, `fail` (raise in the format) and `prefix` / `rename` (re-raise under another
argument name). The checks that raise it are in `checks.py` (Python values: `integer`, `real`,
`boolean`, `choice`) and `tensors.py` (tensors: `positions`, `check_float_tensor`, ...); import every name
from `posenc.errors`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import torch

__all__ = ["PosencError", "Raw", "fail", "prefix", "rename"]


class PosencError(ValueError):
    """Raised for any invalid input to posenc. A `ValueError`, so existing handlers still catch it.

    Attributes:
        arg: the argument's name (`"position_ids"`, `"config['rope_theta']"`), or None for a free message.
        expected: what would have been accepted (text), or None.
        got: what arrived, as shown in the message (text), or None.
    """

    def __init__(self, message: str, *, arg: str | None = None, expected: str | None = None, got: str | None = None):
        super().__init__(message)
        self.arg, self.expected, self.got = arg, expected, got


PosencError.__module__ = "posenc.errors"  # its public home: tracebacks and reprs say posenc.errors.PosencError


class Raw(str):
    """Text shown as-is after "got" (no quotes), e.g. `Raw("min -1")`."""


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):  # the device only when it is not the CPU
        where = "" if value.device.type == "cpu" else f" on {value.device}"
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}{where}"
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, type):  # fail(arg, "...", type(x)) shows the type's name
        return value.__name__
    return repr(value)


def _raise(arg: str, expected: str, got: str) -> NoReturn:
    raise PosencError(f"{arg}: expected {expected}, got {got}", arg=arg, expected=expected, got=got)


def fail(arg: str, expected: str, got: Any) -> NoReturn:
    """Raise `PosencError` in the one format: `"<arg>: expected <expected>, got <got>"`.

    Args:
        arg: the argument's name as the caller wrote it (`"position_ids"`, `"config['rope_theta']"`).
        expected: what would have been accepted.
        got: what arrived; tensors show shape, dtype and a non-CPU device, types their name, `Raw` text as-is, the rest `repr`.
    Raises:
        PosencError: always, with `.arg`, `.expected` and `.got` set.
    """
    _raise(arg, expected, _show(got))


@contextlib.contextmanager
def prefix(path: str, *, rename: Mapping[str, str] | None = None) -> Iterator[None]:
    """Re-raise a `PosencError` from the block with its argument placed under `path`.

    `beta_fast: ...` becomes `<path>['beta_fast']: ...`; `short_factor[1]: ...` becomes
    `<path>['short_factor'][1]: ...`. An argument that already starts with `path` is left alone, and
    a message without an argument is prefixed as `<path>: <message>`.

    Args:
        path: where the checked values came from, e.g. `"config['rope_scaling']"`.
        rename: optional map from a checked argument's name to the key the user wrote
            (`{"max_position_embeddings": "original_max_position_embeddings"}`).
    Raises:
        PosencError: the re-raised error (from None, so the traceback shows the check, not the chain).
    """
    try:
        yield
    except PosencError as e:
        if e.arg is None or e.expected is None:
            new = PosencError(f"{path}: {e}", arg=path)
        elif e.arg.startswith(path):
            raise
        else:
            cut = e.arg.find("[")
            head, rest = (e.arg, "") if cut < 0 else (e.arg[:cut], e.arg[cut:])
            head = (rename or {}).get(head, head)
            new = _with_arg(e, f"{path}[{head!r}]{rest}")
        raise new.with_traceback(e.__traceback__) from None


@contextlib.contextmanager
def rename(names: Mapping[str, str]) -> Iterator[None]:
    """Re-raise a `PosencError` from the block under the caller's name for the argument.

    A function that validates through another one's checks (the decoder through `KVCache.reserve`)
    reports its own argument names: `with rename({"positions": "position_ids"}): cache.reserve(...)`.
    Arguments not in `names` (and messages without an argument) pass through unchanged.
    """
    try:
        yield
    except PosencError as e:
        if e.arg not in names or e.expected is None:
            raise
        raise _with_arg(e, names[e.arg]).with_traceback(e.__traceback__) from None


def _with_arg(e: PosencError, arg: str) -> PosencError:
    return PosencError(f"{arg}: expected {e.expected}, got {e.got}", arg=arg, expected=e.expected, got=e.got)
