"""The checks of tensors: integer positions, integer counts and indices, floating-point q/k/v.

`positions` (and `check_int_positions`, `batch_positions` built on it), `assert_values` (a value check
without a host sync), `integer_tensor` and `check_float_tensor`. They raise through `fail`
(`base.py`); the checks of Python values are in `checks.py`; import every name from `posenc.errors`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .base import Raw, fail

__all__ = ["transformed", "positions", "assert_values", "integer_tensor", "check_int_positions", "batch_positions",
           "check_float_tensor"]

MAX_POSITION = 2**53  # the largest |position| `positions` accepts


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


_FUNCTORCH = torch._C._functorch  # torch.func's wrappers (vmap, grad, jvp) and their unwrapping


def transformed(*xs: Any) -> bool:
    """Whether any of `xs` is a tensor wrapped by a torch.func transform (vmap, grad, jvp): its values cannot
    be read on the host (`.item()` is refused) and its memory is not there for a C kernel."""
    return any(isinstance(x, torch.Tensor) and _FUNCTORCH.is_functorch_wrapped_tensor(x) for x in xs)


def assert_values(arg: str, ok: torch.Tensor, expected: str, got: Callable[[], Any] | None = None, *,
                  explain: Callable[[], tuple[str, Any]] | None = None) -> None:
    """Check a condition on tensor values without a host sync; raise `PosencError` where it can.

    Args:
        arg, expected: as `fail` (`expected` is also the device-side message).
        ok: a 0-d bool tensor, True when the values are valid (computed on their device).
        got: called only on failure, to describe what arrived (it may read values).
        explain: instead of `got`, called only on failure to return `(expected, got)`: a message that names
            the culprit more precisely than the generic `expected` (e.g. which row).
    On the CPU in eager mode a failure raises `PosencError` at once (reading a CPU tensor is no sync). On
    an accelerator, or inside `torch.compile`, the check runs on the device (`torch._assert_async`): a
    failure surfaces as a `RuntimeError` with the same text at the next synchronisation, and the hot path
    never waits for the host.
    """
    message = f"{arg}: expected {expected}"
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if transformed(ok):  # under torch.func (vmap over positions): every value underneath, outside it
            while transformed(ok):
                ok = _FUNCTORCH.get_unwrapped(ok)
            with torch._C._DisableFuncTorch():
                if not bool(ok.all()):
                    fail(arg, expected, Raw("other values (under a torch.func transform)"))
            return
        try:
            torch._assert_async(ok, message)
        except RuntimeError:
            fail(arg, *explain()) if explain is not None else fail(arg, expected, got())
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
    if x.layout is not torch.strided:
        fail(arg, "a dense tensor (layout torch.strided)", Raw(f"a tensor of layout {x.layout}"))
    if ndim is not None and x.ndim not in ndim:
        fail(arg, f"a tensor of rank {' or '.join(map(str, ndim))}", x)
    if like is not None and (x.device, x.dtype) != (like[1].device, like[1].dtype):
        fail(arg, f"a tensor on {like[1].device} of dtype {like[1].dtype} (as {like[0]})",
             Raw(f"one on {x.device} of dtype {x.dtype}"))
    return x
