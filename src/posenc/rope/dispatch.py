"""The one dispatch from a rotation request to an implementation: `rotate(q, k, cos, sin, rows, pairing, ...)`.

Everything that rotates (`Rope.apply` / `apply_` / `rotate`, `attention`, the decoder, the cache) comes
through here with tables in hand, so q and k of a layer take the same path with the same table. `choose`
decides the implementation once, asking the C kernel one question (`kernels.cpu.entry(dtype)`: its foreign
function or None); then one kernel call runs and the result goes back. The kernels (`posenc.kernels`) are
leaves: tensors in, tensors out; they know nothing of `Rope`. The decode hot paths of `Rope.apply(_)`,
`rotate_held` (a held table) and `rotate_fresh` (no table), are `fast.py`'s, re-exported here.

Autograd: every implementation behaves as a torch op. Allocating calls are differentiable (the kernels
through the `posenc::rope` custom op, whose backward rotates by -theta). In place, a tensor that requires
grad is rotated out of place and copied back (autograd records the copy); any other tensor is rotated by
the kernel and its version counter is bumped, so a backward that saved it raises, as after `x.mul_(2)`.

Value checks (rows inside the table, positions >= 0) never sync with the host: the C kernel checks the
rows it reads and writes nothing when one is out of range; elsewhere `errors.assert_values` checks on the
device (`torch._assert_async`).
"""

from __future__ import annotations

import os

import torch

from ..errors import Raw, assert_values, fail
from ..errors.tensors import transformed as _transformed
from ..kernels import IMPLS, cpu
from ..kernels.constants import MAX_HEAD_DIM, MAX_ROTARY_DIM, fits
from .apply import apply_rope
from .fast import rotate_fresh, rotate_held

__all__ = ["rotate", "rotate_held", "rotate_fresh", "choose", "triton_available", "check_rows"]

_compiling = torch.compiler.is_compiling  # bound once


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose(impl: str | None, x: torch.Tensor, compute_dtype: torch.dtype | None, rotary_dim: int,
           *others: torch.Tensor | None):
    """`(name, run)`: the implementation to run for `x` (q) and, for the C kernel, its entry (`cpu.entry`;
    None under `torch.compile`, where the custom op calls it). `impl` is checked, or the fastest available is
    taken when None. Under a torch.func transform of `x` or of any of `others` (the other tensors of the call)
    only the reference runs.

    Raises:
        PosencError: an unknown name, or a named implementation that cannot run these inputs.
    """
    default_compute = compute_dtype is None or compute_dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    if impl is None:
        # under torch.compile inductor fuses the reference itself; under torch.func its torch ops are transformed
        if not default_compute or _compiling() or _transformed(x, *others):
            return "reference", None
        if x.is_cpu:  # the C kernel where it runs this dtype and its buffers hold these rows
            run = cpu.entry(x.dtype) if fits(rotary_dim, x.shape[-1]) else None
            return ("reference", None) if run is None else ("cpu", run)
        if x.device.type == "cuda" and triton_available() and x.dtype != torch.float64:
            return "triton", None
        return "reference", None
    if impl not in IMPLS:
        fail("impl", f"None or one of {IMPLS}", impl)
    if impl in ("reference", "compiled"):
        return impl, None
    if not default_compute:
        fail("impl", f"'reference' or 'compiled' for compute_dtype={compute_dtype}", impl)
    if impl == "cpu" and not fits(rotary_dim, x.shape[-1]):
        fail("impl", f"'cpu' with rotary_dim <= {MAX_ROTARY_DIM} and head_dim <= {MAX_HEAD_DIM}",
             Raw(f"rotary_dim {rotary_dim}, head_dim {x.shape[-1]}"))
    if _compiling():
        return impl, None  # traced: the custom op's implementation says at run time if its kernel cannot build
    if _transformed(x, *others):
        fail("impl", "'reference' or None under a torch.func transform (vmap, grad, jvp)", impl)
    if impl == "cpu":
        if x.device.type != "cpu":
            fail("impl", f"'cpu' with CPU tensors (q is on {x.device})", impl)
        run = cpu.entry(x.dtype)
        if run is None:
            why = cpu.unavailable()
            if why is not None:
                fail("impl", "'cpu' to be buildable", Raw(why))
            fail("impl", "'cpu' with float32, bfloat16, float64 or float16 (where the compiler has _Float16)",
                 Raw(str(x.dtype)))
        return impl, run
    if not triton_available():
        fail("impl", "'triton' with the triton package installed (pip install posenc[triton])", impl)
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        fail("impl", f"'triton' with CUDA tensors (q is on {x.device}; TRITON_INTERPRET=1 runs it on CPU)", impl)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        fail("impl", f"'triton' with float32, bfloat16 or float16 (got {x.dtype})", impl)
    return impl, None


def _view4(x: torch.Tensor, layout: str) -> torch.Tensor:
    """`x` as a `[b, h, t, d]` view (no copy) from any supported layout."""
    if layout == "bthd":
        return x.transpose(1, 2)  # [b, h, t, d]
    if layout == "thd":
        return x.unsqueeze(0).transpose(1, 2)  # [1, h, t, d]
    return x


def _unview4(x4: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of `_view4`."""
    if layout == "bthd":
        return x4.transpose(1, 2)  # [b, t, h, d]
    if layout == "thd":
        return x4.transpose(1, 2).squeeze(0)  # [t, h, d]
    return x4


def _per_token_rows(cos: torch.Tensor, sin: torch.Tensor):
    """Per-token tables `[t, r/2]` / `[b, t, r/2]` as rows `[n, r/2]` and the row of each token `[t]` / `[b, t]`."""
    if cos.ndim == 2:  # [t, r/2]: token i reads row i
        return cos.contiguous(), sin.contiguous(), torch.arange(cos.shape[0], device=cos.device)
    t = cos.shape[-2]
    rows = torch.arange(cos.shape[:-1].numel(), device=cos.device)  # [b * t]
    rows = rows.view(cos.shape[0], t)  # [b, t]
    return cos.reshape(-1, cos.shape[-1]).contiguous(), sin.reshape(-1, sin.shape[-1]).contiguous(), rows


def check_rows(rows: torch.Tensor, n: int, rows_arg: str) -> None:
    assert_values(rows_arg, ((rows >= 0) & (rows < n)).all(), f"positions in [0, {n}) (the rows of the table)",
                  lambda: Raw(f"values in [{int(rows.min())}, {int(rows.max())}]"))


def rotate(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor | None,
           pairing: str, *, inplace: bool = False, impl: str | None = None, layout: str = "bhtd",
           compute_dtype: torch.dtype | None = None, rows_arg: str = "position_ids"):
    """Rotate q (and k) by the tables, with the chosen implementation. The caller checked shapes and dtypes.

    Args:
        q, k: in `layout` (k may be None); they may differ in heads only.
        cos, sin: float32 tables: `[n, r/2]` rows indexed by `rows`, or, with `rows=None`, per-token tables
            `[t, r/2]` / `[b, t, r/2]` (broadcast over heads).
        rows: int64 `[t]` or `[b, t]`, the table row of each token (its position, for a `RopeTable`), or None.
        rows_arg: the argument named when a row is outside the table.
    Returns:
        `(q_rotated, k_rotated)` (k_rotated None when k is None): q and k themselves when `inplace`.
    """
    if k is not None and k.dtype != q.dtype:  # one kernel call per dtype, each chosen for its tensor
        opts = dict(inplace=inplace, impl=impl, layout=layout, compute_dtype=compute_dtype, rows_arg=rows_arg)
        return rotate(q, None, cos, sin, rows, pairing, **opts)[0], rotate(k, None, cos, sin, rows, pairing, **opts)[0]
    name, run = choose(impl, q, compute_dtype, 2 * cos.shape[-1], k, cos, rows)
    if name in ("reference", "compiled"):
        xs = [x for x in (q, k) if x is not None]
        if rows is not None:
            check_rows(rows, cos.shape[0], rows_arg)
            cos, sin = cos[rows], sin[rows]  # [t, r/2] or [b, t, r/2]
        if name == "compiled":
            from .compiled import apply_rope_compiled as fn
        else:
            fn = apply_rope
        outs = [fn(x, cos, sin, pairing=pairing, layout=layout, compute_dtype=compute_dtype) for x in xs]
        if inplace:
            outs = [x.copy_(o) for x, o in zip(xs, outs)]
        return outs[0], outs[1] if k is not None else None

    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    q4 = _view4(q, layout)  # [b, hq, t, d]
    k4 = _view4(k, layout) if k is not None else None  # [b, hk, t, d]
    if run is not None and not grad:  # the C kernel, called here through ctypes
        if rows is None:
            cos, sin, rows = _per_token_rows(cos, sin)
        if inplace:
            q_out, k_out = q, k
        else:
            q_out, k_out = torch.empty_like(q), None if k is None else torch.empty_like(k)
        ret = cpu.rope(q4, k4, _view4(q_out, layout), None if k is None else _view4(k_out, layout), cos, sin,
                       rows if rows.is_contiguous() else rows.contiguous(), pairing, run=run)
        if ret != 0:
            _kernel_refused(ret, rows, cos.shape[0], rows_arg)
        if inplace:  # the kernel wrote through ctypes: tell autograd, as a torch in-place op would
            torch.autograd.graph.increment_version(q if k is None else (q, k))
        return q_out, k_out

    # the custom ops: autograd (cpu, triton), torch.compile (cpu), or Triton
    if rows is None:
        cos, sin, rows = _per_token_rows(cos, sin)
    else:
        check_rows(rows, cos.shape[0], rows_arg)
    from ..kernels import ops

    k4 = k4 if k4 is not None else q4[:, :0]  # no heads when k is None
    if inplace and not grad and not (name == "triton" and pairing == "interleaved_to_split_half"):
        ops.rope_(q4, k4, cos, sin, rows.contiguous(), pairing, name, "table", 1.0)  # the op bumps versions
        return q, k
    q_out, k_out = ops.rope(q4, k4, cos, sin, rows.contiguous(), pairing, name, False, "table", 1.0)  # [b, h, t, d]
    q_out, k_out = _unview4(q_out, layout), _unview4(k_out, layout) if k is not None else None
    if inplace:  # autograd records the copies (or the in-place kernel cannot run in place)
        return q.copy_(q_out), k.copy_(k_out) if k is not None else None
    return q_out, k_out


def _kernel_refused(ret: int, rows: torch.Tensor, n: int, rows_arg: str):
    """The kernel wrote nothing: a row outside the table (raised by `check_rows`, by name) or a bug."""
    if ret != cpu.BAD_ARGUMENTS:
        check_rows(rows, n, rows_arg)
    raise RuntimeError(f"posenc cpu kernel refused its arguments (code {ret}; a bug: dispatch checks them)")
