"""The one dispatch from a rotation request to an implementation: `rotate(q, k, cos, sin, rows, pairing, ...)`.

Everything that rotates (`Rope.apply` / `apply_` / `rotate`, `attention`, the decoder, the cache) comes
through here with tables in hand, so q and k of a layer take the same path with the same table. `choose`
decides the implementation once, asking the C kernel one question (`kernels.cpu.entry(dtype)`: its foreign
function or None); then one kernel call runs and the result goes back. The kernels (`posenc.kernels`) are
leaves: tensors in, tensors out; they know nothing of `Rope`. `rotate_held` is the decode hot path of
`Rope.apply(_)` with a held table: metadata checks and one C call; `rotate_fresh` the same path without a
table, after making the angles of the call's positions.

Autograd: every implementation behaves as a torch op. Allocating calls are differentiable (the kernels
through the `posenc::rope` custom op, whose backward rotates by -theta). In place, a tensor that requires
grad is rotated out of place and copied back (autograd records the copy); any other tensor is rotated by
the kernel and its version counter is bumped, so a backward that saved it raises, as after `x.mul_(2)`.

Value checks (rows inside the table, positions >= 0) never sync with the host: the C kernel checks the
rows it reads and writes nothing when one is out of range; elsewhere `errors.assert_values` checks on the
device (`torch._assert_async`).
"""

from __future__ import annotations

import ctypes
import os

import torch

from ..errors import MAX_POSITION, Raw, assert_values, fail
from ..errors.tensors import transformed as _transformed
from ..kernels import IMPLS, cpu
from ..kernels.constants import MAX_HEAD_DIM, MAX_ROTARY_DIM, fits
from .aliasing import overlaps_itself
from .apply import apply_rope
from .inputs import check_position_values, check_x
from .tables import float32_cos_sin

__all__ = ["rotate", "rotate_held", "rotate_fresh", "choose", "triton_available", "check_rows"]

# torch.autograd.graph.increment_version without its Python wrapper (a visible share of a decode call, see
# benchmarks/call_overhead.py); the public function where a torch lacks the private one
_increment_version = getattr(torch._C, "_increment_version", None) or torch.autograd.graph.increment_version
# the hot path's names bound once (each attribute lookup is a visible share of a decode call)
Tensor, _INT64, _grad_enabled, _num_threads = torch.Tensor, torch.int64, torch.is_grad_enabled, torch.get_num_threads
_inference_mode, _compiling = torch.is_inference_mode_enabled, torch.compiler.is_compiling
_int64_at = ctypes.c_int64.from_address  # an int64 read from CPU memory: a decode step's position
# one int64 zero in immutable memory: the row of a one-token call without a table (`rotate_held(rows=None)`)
_ZERO_ROW = bytes(8)
_ZERO_ROW_ADDRESS = ctypes.cast(ctypes.c_char_p(_ZERO_ROW), ctypes.c_void_p).value


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


def rotate_held(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, held: tuple, layout: str, head_dim: int,
                inplace: bool):
    """The decode hot path of `Rope.apply(_)` with a held table: metadata checks and one C kernel call.

    It takes only what it can run as is: float q and k of one dtype that the kernel runs, on the CPU, in a
    4-d layout ("bhtd" or "bthd") of `head_dim` channels, differing in heads only; contiguous int64 rows
    `[t]`, `[1, t]` or `[b, t]`; no autograd recording; not under `torch.compile` (the caller checks). It
    reads no value on the host: the kernel checks the rows and, in place, whether q's and k's memory ranges
    meet. Every line counts at decode (benchmarks/call_overhead.py times it): one pass over the metadata,
    strides as torch returns them, one `struct` pack, one foreign call.

    Args:
        q, k: `[b, hq, t, d]` / `[b, hk, t, d]` ("bhtd") or `[b, t, hq, d]` / `[b, t, hk, d]` ("bthd").
        rows: the table row (position) of each token, `[t]` or `[b, t]`; None for one token (t = 1) reading
            row 0 (a one-row table of that token's angles: `Rope.apply` without a table).
        held: the table's `RopeTable.held` (its CPU addresses, sizes and pairing code; rows the kernel holds).
    Returns:
        `(q_rotated, k_rotated)` (q and k themselves when `inplace`), or None when the call is one for
        `rotate`'s general path, with nothing written: other metadata, a row outside the table, q and k
        whose memory ranges meet (the general path decides exactly, and refuses or rotates).
    """
    if type(q) is not Tensor or type(k) is not Tensor:
        return None
    dtype = q.dtype
    if (k.dtype is not dtype or not (q.is_cpu and k.is_cpu) or _grad_enabled() and (q.requires_grad or k.requires_grad)
            or rows is not None and (type(rows) is not Tensor or rows.dtype is not _INT64 or not rows.is_cpu
                                     or not rows.is_contiguous())):
        return None
    qs, ks = q.shape, k.shape
    if len(qs) != 4 or len(ks) != 4:
        return None
    if layout == "bhtd":
        b, hq, t, d = qs
        kb, hk, kt, kd = ks
    elif layout == "bthd":
        b, t, hq, d = qs
        kb, kt, hk, kd = ks
    else:  # another layout, or not a string
        return None
    cos, sin, n, half, pairing = held
    if kb != b or kt != t or d != head_dim or kd != d:
        return None
    rs = (1,) if rows is None else rows.shape
    if len(rs) == 1 and rs[0] == t:
        rows_b = 0
    elif len(rs) == 2 and rs[1] == t and rs[0] in (1, b):
        rows_b = t if rs[0] > 1 else 0
    else:
        return None
    run = cpu.entry(dtype)
    if run is None:
        return None
    try:
        qp, kp, q4, k4 = q.data_ptr(), k.data_ptr(), q.stride(), k.stride()  # layout's dims
        rp = _ZERO_ROW_ADDRESS if rows is None else rows.data_ptr()
    except RuntimeError:  # no memory to read (a torch.func wrapper): the general path runs the reference
        return None
    if inplace:
        if not _inference_mode() and (q.is_inference() or k.is_inference()):
            return None  # torch allows no in-place update of an inference tensor here: the general path says so
        if not q.is_contiguous() and overlaps_itself(q) or not k.is_contiguous() and overlaps_itself(k):
            return None  # rows as_strided made to meet (the kernel refuses q and k that meet, and stride 0)
        q_out, k_out, qop, kop, qo4, ko4, flags = q, k, qp, kp, q4, k4, cpu.FLAG_CHECK_OVERLAP
    else:
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # q's and k's strides (dense inputs)
        qop, kop, qo4, ko4 = q_out.data_ptr(), k_out.data_ptr(), q_out.stride(), k_out.stride()
        large = b * (hq + hk) * t * d * q.element_size() >= cpu.LARGE_OUTPUT_BYTES  # bytes of the outputs
        flags = cpu.FLAG_HUGE_PAGES if large and cpu.huge_pages_allowed() else 0
    if layout == "bthd":  # strides over [b, h, t, d]: dims 1 and 2 swap
        q4, k4, qo4, ko4 = ((s[0], s[2], s[1], s[3]) for s in (q4, k4, qo4, ko4))
    ret = run(cpu.pack_args(
        qp, qop, kp, kop, cos, sin, rp, b, hq, hk, t, d, *q4, *qo4, *k4, *ko4, n, half, rows_b,
        cpu.DTYPES[dtype], pairing, _num_threads(), flags))
    if ret != 0:
        return None  # nothing written: the general path names what is wrong (or rotates aliasing-free views)
    if inplace:  # the kernel wrote through ctypes: tell autograd, as a torch in-place op would
        _increment_version((q, k))
    return q_out, k_out


def rotate_fresh(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, rope, layout: str,
                 allow_negative: bool, inplace: bool):
    """`Rope.apply(_)` without a table on the CPU, int64 `[t]` or `[b, t]` positions: the angles of these
    positions only (one product, one cos, one sin, from the ladder the `Rope` keeps), read by the C kernel as a
    table with a row per token through `rotate_held`. The caller checked that `rope._code` is set (the ladder
    is kept and the kernel holds these rows).

    Returns:
        As `rotate_held`: None, with nothing written, for a call it does not take (then the general path
        decides, and refuses by name or rotates).
    """
    n = position_ids.numel()
    if n == 1:  # a decode step: its one position read from CPU memory (no torch op, no sync)
        try:
            p = _int64_at(position_ids.data_ptr()).value
        except RuntimeError:  # no memory to read (a torch.func wrapper): the general path
            return None
        if p > MAX_POSITION or p < (-MAX_POSITION if allow_negative else 0):
            return None  # the general path refuses it by name (after q's and k's own errors)
        theta = position_ids * rope._freq  # [.., r/2]: the position converted to float32, as float32_cos_sin
        cos, sin = theta.cos(), theta.sin_()
        if rope._factor != 1.0:
            cos, sin = cos * rope._factor, sin * rope._factor
        held = (cos.data_ptr(), sin.data_ptr(), 1, rope.rotary_dim // 2, rope._code)
        return rotate_held(q, k, None, held, layout, rope.head_dim, inplace)  # row 0
    check_x(rope.head_dim, "q", q, layout)  # q's and k's own errors first, as on the general path
    check_x(rope.head_dim, "k", k, layout)
    check_position_values(position_ids, allow_negative)
    cos, sin = float32_cos_sin(position_ids, rope._freq, rope._factor)  # [t, r/2] / [b, t, r/2] each
    try:
        held = (cos.data_ptr(), sin.data_ptr(), n, rope.rotary_dim // 2, rope._code)  # token i reads row i
    except RuntimeError:  # no memory to read (positions under a torch.func transform): the general path
        return None
    rows = torch.arange(n) if position_ids.ndim == 1 else torch.arange(n).view(position_ids.shape)  # [t] / [b, t]
    return rotate_held(q, k, rows, held, layout, rope.head_dim, inplace)


def _kernel_refused(ret: int, rows: torch.Tensor, n: int, rows_arg: str):
    """The kernel wrote nothing: a row outside the table (raised by `check_rows`, by name) or a bug."""
    if ret != cpu.BAD_ARGUMENTS:
        check_rows(rows, n, rows_arg)
    raise RuntimeError(f"posenc cpu kernel refused its arguments (code {ret}; a bug: dispatch checks them)")
