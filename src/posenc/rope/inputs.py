"""The checks of what a `Rope` call receives: q and k (and one tensor for `rotate`), and their positions.

Plain functions of the `Rope`'s facts they need (`head_dim`), called by `Rope.apply` / `apply_` / `rotate`
(rope/spec.py). Metadata only: values (positions inside a table, >= 0) are checked where they are read,
without a host sync. They raise through `posenc.errors`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ..errors import MAX_POSITION, Raw, assert_values, check_float_tensor, choice, fail, positions
from .aliasing import written_twice
from .apply import LAYOUTS

__all__ = ["check_x", "check_positions", "check_pair", "check_position_values"]

_RANKS = {"bhtd": 4, "bthd": 4, "thd": 3}  # the layouts q and k may come in, and their ranks
_compiling = torch.compiler.is_compiling  # bound once: the decode hot path calls it
_READ_LIMIT = 64  # positions read in Python below this many: cheaper than the ops of a check on the tensor


def check_x(head_dim: int, arg: str, x: torch.Tensor, layout: str) -> None:
    """Raise `PosencError` naming `arg` unless `x` is a float tensor of `layout`'s rank with `head_dim` channels."""
    rank = _RANKS.get(layout) if type(layout) is str else None
    if (type(x) is torch.Tensor and x.ndim == rank and x.dtype.is_floating_point and x.shape[-1] == head_dim
            and x.layout is torch.strided):
        return  # the decode hot path: metadata only, a few hundred nanoseconds
    choice("layout", layout, ("bhtd", "bthd", "thd"))
    check_float_tensor(arg, x, ndim=(LAYOUTS[layout][0],))
    if x.shape[-1] != head_dim:
        fail(arg, f"last dim = head_dim = {head_dim}", x)


def check_pair(q: torch.Tensor, k: torch.Tensor, layout: str, inplace: bool) -> None:
    """Raise `PosencError` unless q and k (each passed by `check_x`) differ in heads only, share a device and,
    for `apply_`, are tensors torch lets this call change: no leaf that requires grad, no inference tensor
    outside inference mode, no shared or repeated memory."""
    qs, ks, heads = q.shape, k.shape, q.ndim + LAYOUTS[layout][2]
    if qs[:heads] != ks[:heads] or qs[heads + 1:] != ks[heads + 1:]:
        for a in range(q.ndim):
            if a != heads and qs[a] != ks[a]:
                fail("k", f"size {qs[a]} in dim {a} (as q {tuple(qs)}; only heads may differ)", k)
    if not (q.is_cpu and k.is_cpu) and k.device != q.device:
        fail("k", f"a tensor on the device of q ({q.device})", k)
    if not inplace:
        return
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        for arg, x in (("q", q), ("k", k)):
            if x.requires_grad and x.is_leaf:
                fail(arg, "a tensor autograd lets apply_ change (not a leaf that requires grad: use apply)",
                     Raw("a leaf tensor with requires_grad=True"))
    if _compiling():
        return  # tensor addresses and inference flags: eager only
    if not torch.is_inference_mode_enabled() and (q.is_inference() or k.is_inference()):
        arg = "q" if q.is_inference() else "k"  # torch refuses x.mul_(2) here too
        fail(arg, "a tensor torch lets apply_ change (an inference tensor only inside torch.inference_mode(); "
             "clone it or rotate under inference_mode)", Raw("an inference tensor outside inference mode"))
    twice = written_twice(q, k)
    if twice == ("k", "q"):
        fail("k", "a tensor that shares no memory with q (apply_ writes both; rotate one tensor with rotate)",
             Raw("a view of q's memory"))
    if twice:
        fail(twice[0], "a tensor whose elements are distinct memory (apply_ writes each once: clone a broadcast "
             "or as_strided view)", Raw("a view that repeats memory"))


def check_positions(position_ids: Any, x: torch.Tensor, layout: str, arg: str) -> torch.Tensor:
    """Positions that fit `x` (tokens, batch, device); their values are checked where they are read."""
    t = x.shape[LAYOUTS[layout][1]]
    if (type(position_ids) is torch.Tensor and position_ids.dtype is torch.int64 and position_ids.ndim == 1
            and position_ids.shape[0] == t and (position_ids.is_cpu and x.is_cpu or position_ids.device == x.device)):
        return position_ids  # the decode hot path
    position_ids = positions("position_ids", position_ids, device=x.device, check_values=False)
    if position_ids.ndim == 0 or position_ids.shape[-1] != t:
        fail("position_ids", f"last dim = {t} tokens (as {arg})", position_ids)
    if position_ids.ndim >= 2:
        if layout == "thd":
            fail("position_ids", "shape [t] for the packed 'thd' layout", position_ids)
        b = position_ids.shape[-2]
        if b not in (1, x.shape[0]):
            fail("position_ids", f"batch size 1 or {x.shape[0]} (as {arg})", position_ids)
    return position_ids


def check_position_values(position_ids: torch.Tensor, allow_negative: bool) -> None:
    """The value check of `errors.positions` (>= 0 unless allowed, |p| <= 2**53) for int64 positions, no host
    sync. A few contiguous CPU positions (a decode batch) are read from memory in Python, no torch op; others
    take one pass on their device: a clamp, a compare, an `all` (skipped for one position) and the assert,
    4 ops where two separate checks cost 8."""
    low = -MAX_POSITION if allow_negative else 0
    n = position_ids.numel()
    if 0 < n <= _READ_LIMIT and position_ids.is_cpu and position_ids.is_contiguous() and not _compiling():
        try:
            values = (ctypes.c_int64 * n).from_address(position_ids.data_ptr())[:]  # a list: min/max at C speed
        except RuntimeError:  # no memory to read (a torch.func wrapper): the check on the tensor below
            pass
        else:
            if low <= min(values) and max(values) <= MAX_POSITION:
                return
            fail("position_ids", *_out_of_range(position_ids, allow_negative))
    ok = position_ids.clamp(low, MAX_POSITION) == position_ids
    if ok.numel() != 1:
        ok = ok.all()
    expected = ("positions with |p| <= 2**53" if allow_negative
                else "positions >= 0 (pass allow_negative=True to rotate backwards) and <= 2**53")
    assert_values("position_ids", ok, expected, explain=lambda: _out_of_range(position_ids, allow_negative))


def _out_of_range(position_ids: torch.Tensor, allow_negative: bool) -> tuple[str, Any]:
    """`(expected, got)` of a failed `check_position_values`, worded as `errors.positions` words them."""
    lo, hi = int(position_ids.min()), int(position_ids.max())
    if lo < 0 and not allow_negative:
        return "positions >= 0 (pass allow_negative=True to rotate backwards)", Raw(f"min {lo}")
    return ("positions with |p| <= 2**53 (exact in float64; p + 1 and p - q stay within int64)",
            Raw(f"values in [{lo}, {hi}]"))
