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
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

__all__ = [
    "PosencError",
    "Raw",
    "fail",
    "assert_values",
    "prefix",
    "rename",
    "integer",
    "real",
    "boolean",
    "choice",
    "positions",
    "integer_tensor",
    "check_int_positions",
    "batch_positions",
    "check_float_tensor",
]


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
MAX_POSITION = 2**53  # the largest |position| `positions` accepts


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


_SHAPE_ANY = (str, type(None))


def _shape_text(pattern: Sequence[Any]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in pattern) + "]"


def positions(arg: str, x: Any, *, shapes: Sequence[Sequence[Any]] | None = None, allow_negative: bool = False,
              check_values: bool = True, device: torch.device | None = None, negative_hint: str = "") -> torch.Tensor:
    """Check a tensor of integer logical positions and return it (unsigned dtypes as int64).

    Args:
        arg: the argument's name for the message (`"position_ids"`, `"k_positions"`).
        x: a tensor of any signed integer dtype; uint8/16/32/64 are converted to int64 (torch has
            no comparison or indexing for uint16/32/64), so every caller gets a dtype it can index with.
        shapes: allowed shape patterns, each a tuple of sizes: an int must match, a str or None matches
            any size and is shown by that name (`[(5,), ("b", 5)]` reads "shape [5] or [b, 5]").
        allow_negative: accept positions < 0 (rotating backwards, relative offsets).
        check_values: run the negativity check; it syncs with the host once, so a hot path that
            has already checked (or cannot afford the sync, e.g. under CUDA-graph capture) passes False.
        device: the device the positions must live on (that of q, or of the table), or None.
        negative_hint: text appended to "positions >= 0" in the message, e.g. "(pass allow_negative=True ...)".
    Returns:
        `x`, or `x.long()` when it was unsigned.
    Raises:
        PosencError: not a tensor, a float/bool/complex dtype, a shape outside `shapes`, another device,
            a meta tensor, a negative value when not allowed, or |value| > 2**53 (`MAX_POSITION`).
    """
    if not isinstance(x, torch.Tensor):
        fail(arg, "an integer torch.Tensor", type(x))
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        fail(arg, "an integer dtype (int32 or int64) of logical positions", x)
    if shapes is not None and not any(
            len(p) == x.ndim and all(isinstance(s, _SHAPE_ANY) or s == n for s, n in zip(p, x.shape)) for p in shapes):
        texts = [_shape_text(p) for p in shapes]
        fail(arg, "shape " + (", ".join(texts[:-1]) + " or " if len(texts) > 1 else "") + texts[-1], x)
    if device is not None and x.device != torch.device(device):
        fail(arg, f"a tensor on {torch.device(device)} (the device of the tensors it positions)", Raw(f"one on {x.device}"))
    if check_values and x.is_meta:  # positions are values: a meta tensor has none to read
        fail(arg, "a tensor with values (not on the meta device)", Raw("a meta tensor"))
    if not x.dtype.is_signed:
        x = x.long()  # uint16/32/64 support no arithmetic in torch; a wrapped uint64 shows up as negative below
    # checked on the tensor's device, no host sync (errors.assert_values): a negative position is a bug (left
    # padding) unless asked for, and a position beyond 2**53 is not exact in float64 and lets p + 1 or p - q
    # overflow int64 (wrapping silently)
    if check_values and x.numel():
        if not allow_negative:
            assert_values(arg, (x >= 0).all(), "positions >= 0" + (f" {negative_hint}" if negative_hint else ""),
                          lambda: Raw(f"min {int(x.min())}"))
        if x.dtype == torch.int64:  # narrower dtypes cannot exceed 2**53 (and would wrap the bound)
            assert_values(arg, ((x <= MAX_POSITION) & (x >= -MAX_POSITION)).all(),
                          "positions with |p| <= 2**53 (exact in float64; p + 1 and p - q stay within int64)",
                          lambda: Raw(f"values in [{int(x.min())}, {int(x.max())}]"))
    return x


def assert_values(arg: str, ok: torch.Tensor, expected: str, got: Callable[[], Any]) -> None:
    """Check a condition on tensor values without a host sync; raise `PosencError` where it can.

    Args:
        arg, expected: as `fail`.
        ok: a 0-d bool tensor, True when the values are valid (computed on their device).
        got: called only on failure, to describe what arrived (it may read values).
    On the CPU in eager mode a failure raises `PosencError` at once (reading a CPU tensor is no sync). On
    an accelerator, or inside `torch.compile`, the check runs on the device (`torch._assert_async`): a
    failure surfaces as a `RuntimeError` with the same text at the next synchronisation, and the hot path
    never waits for the host.
    """
    message = f"{arg}: expected {expected}"
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        try:
            torch._assert_async(ok, message)
        except RuntimeError:
            fail(arg, expected, got())
        return
    torch._assert_async(ok, message)


def integer_tensor(arg: str, x: Any, *, ndim: tuple[int, ...] | None = None, what: str | None = None) -> torch.Tensor:
    """Return `x` as int64 after checking it is a tensor of an integer dtype (not bool), of one of the ranks.

    For integer tensors that are not positions (counts, row indices); `what` is the "expected" text.
    """
    what = what or "an integer torch.Tensor" + ("" if ndim is None else f" of rank {' or '.join(map(str, ndim))}")
    if not isinstance(x, torch.Tensor):
        fail(arg, what, type(x))
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        fail(arg, what, x)
    if ndim is not None and x.ndim not in ndim:
        fail(arg, what, x)
    if x.is_meta:  # counts and ids are values: a meta tensor has none to read
        fail(arg, "a tensor with values (not on the meta device)", Raw("a meta tensor"))
    return x.long()


def check_int_positions(arg: str, x: Any, *, allow_negative: bool = False) -> torch.Tensor:
    """Check that `x` is an integer tensor of logical positions (>= 0 unless allowed); see `positions`."""
    return positions(arg, x, allow_negative=allow_negative,
                     negative_hint="" if allow_negative else "(pass allow_negative=True to rotate backwards)")


def batch_positions(arg: str, x: Any, batch: int, tokens: int, *, allow_negative: bool = True,
                    device: torch.device | None = None) -> torch.Tensor:
    """Check `[t]` or `[b, t]` integer positions (b may be 1) and return them as int64 `[batch, tokens]`."""
    x = positions(arg, x, allow_negative=allow_negative, device=device)
    if x.ndim not in (1, 2) or x.shape[-1] != tokens:
        fail(arg, f"shape [{tokens}] or [b, {tokens}]", x)
    if x.ndim == 2 and x.shape[0] not in (1, batch):
        fail(arg, f"batch size 1 or {batch}", x)
    x = x.long()
    return (x[None] if x.ndim == 1 else x).expand(batch, tokens).contiguous()  # [b, t]


def check_float_tensor(arg: str, x: Any, *, ndim: tuple[int, ...] | None = None,
                       like: tuple[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Check that `x` is a floating-point tensor, optionally of one of the given ranks.

    `like=(name, other)` also requires `other`'s device and dtype (k and v beside q).
    """
    if not isinstance(x, torch.Tensor):
        fail(arg, "a floating-point torch.Tensor", type(x))
    if not x.dtype.is_floating_point:
        fail(arg, "a floating-point dtype (float32, bfloat16, float16 or float64)", x)
    if ndim is not None and x.ndim not in ndim:
        fail(arg, f"a tensor of rank {' or '.join(map(str, ndim))}", x)
    if like is not None and (x.device, x.dtype) != (like[1].device, like[1].dtype):
        fail(arg, f"a tensor on {like[1].device} of dtype {like[1].dtype} (as {like[0]})",
             Raw(f"one on {x.device} of dtype {x.dtype}"))
    return x
