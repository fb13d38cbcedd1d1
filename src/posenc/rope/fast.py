"""The decode hot paths of `Rope.apply(_)` on the CPU: metadata checks and one C kernel call, with nothing in
between that a decode step would feel.

- `rotate_held(q, k, rows, held, ...)`: a held `RopeTable` (row p for position p).
- `rotate_fresh(q, k, position_ids, rope, ...)`: no table; the angles of the call's positions only, from the
  ladder the frozen `Rope` keeps, made in one C call where it gives torch's bits (`kernels.angles`: torch's
  own vector cos/sin), else in torch's three ops (one product, one cos, one sin; the attention factor in
  place), read by the kernel as a table with a row per token.

Both take only what they can run as is and return None otherwise, with nothing written: the general path
(`Rope._apply` -> `dispatch.rotate`) then checks everything, names what is wrong, or rotates. Every line
counts at decode (benchmarks/call_overhead.py times them; tests/rope/test_spec_no_table.py counts their torch
ops): one pass over the metadata, strides as torch returns them, one `struct` pack, one foreign call. They
read no value on the host except a few positions from CPU memory (no torch op, no sync).
"""

from __future__ import annotations

import ctypes
from array import array

import torch

from ..errors import MAX_POSITION
from ..kernels import angles, cpu
from .aliasing import overlaps_itself
from .inputs import check_position_values, check_x
from .tables import float32_cos_sin

__all__ = ["rotate_held", "rotate_fresh", "cos_sin_fresh"]

# torch.autograd.graph.increment_version without its Python wrapper (a visible share of a decode call, see
# benchmarks/call_overhead.py); the public function where a torch lacks the private one
_increment_version = getattr(torch._C, "_increment_version", None) or torch.autograd.graph.increment_version
# the hot path's names bound once (each attribute lookup is a visible share of a decode call)
Tensor, _INT64, _grad_enabled, _num_threads = torch.Tensor, torch.int64, torch.is_grad_enabled, torch.get_num_threads
_inference_mode, _compiling = torch.is_inference_mode_enabled, torch.compiler.is_compiling
# rows 0, 1, .., _ROWS - 1 as int64 in immutable memory: "token i reads row i" of the angles a call without a
# table makes (`rotate_fresh`); a longer call (a prefill) makes its rows with one arange
_ROWS = 4096
_ROW_BYTES = array("q", range(_ROWS)).tobytes()
_ROWS_ADDRESS = ctypes.cast(ctypes.c_char_p(_ROW_BYTES), ctypes.c_void_p).value


def rotate_held(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, held: tuple, layout: str, head_dim: int,
                inplace: bool):
    """`Rope.apply(_)` with a held table: the kernel reads row `rows[..]` of the table for each token.

    It takes only what it can run as is: float q and k of one dtype that the kernel runs, on the CPU, in a
    4-d layout ("bhtd" or "bthd") of `head_dim` channels, differing in heads only; contiguous int64 rows
    `[t]`, `[1, t]` or `[b, t]`; no autograd recording; not under `torch.compile` (the caller checks). The
    kernel checks the rows and, in place, whether q's and k's memory ranges meet.

    Args:
        q, k: `[b, hq, t, d]` / `[b, hk, t, d]` ("bhtd") or `[b, t, hq, d]` / `[b, t, hk, d]` ("bthd").
        rows: the table row (position) of each token, `[t]` or `[b, t]`.
        held: the table's `RopeTable.held` (its CPU addresses, sizes and pairing code; rows the kernel holds).
    Returns:
        `(q_rotated, k_rotated)` (q and k themselves when `inplace`), or None when the call is one for
        `dispatch.rotate`'s general path, with nothing written: other metadata, a row outside the table, q and
        k whose memory ranges meet (the general path decides exactly, and refuses or rotates).
    """
    if type(rows) is not Tensor or rows.dtype is not _INT64 or not rows.is_cpu or not rows.is_contiguous():
        return None
    try:
        address = rows.data_ptr()
    except RuntimeError:  # no memory to read (a torch.func wrapper): the general path
        return None
    return _run(q, k, rows.shape, address, held, layout, head_dim, inplace)


def rotate_fresh(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, rope, layout: str,
                 allow_negative: bool, inplace: bool):
    """`Rope.apply(_)` without a table, int64 `[t]` or `[b, t]` CPU positions (the caller checked them and that
    `rope._code` is set: the ladder is kept and the kernel holds these rows).

    Returns:
        As `rotate_held`: None, with nothing written, for a call it does not take (then the general path
        decides, and refuses by name, in the order of its checks, or rotates).
    """
    n, half = position_ids.numel(), rope.rotary_dim // 2
    low = -MAX_POSITION if allow_negative else 0
    run = angles.entry() if 0 < n * half <= angles.LIMIT else None
    if run is not None and position_ids.is_contiguous():  # one C call: range check, torch's cos/sin, rotation
        try:
            address = position_ids.data_ptr()
        except RuntimeError:  # no memory to read (a torch.func wrapper): the general path
            return None
        factor = rope._factor
        fresh = (run[3], (address, rope._freq.data_ptr(), 0, 0, run[1], run[2], run[4], n, half, angles.MODE, low,
                          MAX_POSITION, factor, factor != 1.0))
        return _run(q, k, position_ids.shape, 0, (0, 0, n, half, rope._code), layout, rope.head_dim, inplace, fresh)
    # torch's ops: the range check on the positions, then one product, one cos, one sin
    if n == 0:
        return None
    check_x(rope.head_dim, "q", q, layout)  # q's and k's own errors first, as on the general path
    check_x(rope.head_dim, "k", k, layout)
    check_position_values(position_ids, allow_negative)
    if position_ids.shape[-1] == 1:  # [1] or [b, 1]: [.., 1] * [r/2] is already a row per token
        theta = position_ids * rope._freq  # [.., r/2]: each position converted to float32, as float32_cos_sin
        cos_t, sin_t = theta.cos(), theta.sin_()
        if rope._factor != 1.0:
            cos_t, sin_t = cos_t.mul_(rope._factor), sin_t.mul_(rope._factor)
    else:
        cos_t, sin_t = float32_cos_sin(position_ids, rope._freq, rope._factor)  # [t, r/2] / [b, t, r/2] each
    cos, sin = cos_t.data_ptr(), sin_t.data_ptr()
    if n <= _ROWS:
        return _run(q, k, position_ids.shape, _ROWS_ADDRESS, (cos, sin, n, half, rope._code), layout, rope.head_dim,
                    inplace)
    rows = torch.arange(n)  # token i reads row i
    return _run(q, k, position_ids.shape, rows.data_ptr(), (cos, sin, n, half, rope._code), layout, rope.head_dim,
                inplace)


def cos_sin_fresh(position_ids: torch.Tensor, freq: torch.Tensor, factor: float, allow_negative: bool):
    """`Rope.cos_sin` of a few contiguous int64 CPU positions in one C call (`kernels.angles`), or None for a call
    it does not take (more angles than `kernels.angles.LIMIT`, no C path here, under `torch.compile`, a position
    out of range: the caller checks and names it)."""
    if (not position_ids.is_cpu or position_ids.numel() * freq.shape[0] > angles.LIMIT
            or not position_ids.is_contiguous() or _compiling()):
        return None
    run = angles.entry()
    if run is None:
        return None
    return angles.cos_sin(run, position_ids, freq, factor, -MAX_POSITION if allow_negative else 0, MAX_POSITION)


def _run(q, k, rows_shape, rows_address, held, layout, head_dim, inplace, fresh=None):
    """The kernel call of `rotate_held` / `rotate_fresh`: rows at `rows_address`, `rows_shape` `[t]` / `[b, t]`
    (row-major); with `fresh` (`(posenc_rope_fresh, AnglesArgs' fields but the thread count)`) the C side makes
    the table and its rows first (then `held`'s addresses and `rows_address` are not read), all of it packed
    in one buffer."""
    if type(q) is not Tensor or type(k) is not Tensor:
        return None
    dtype = q.dtype
    if (k.dtype is not dtype or not (q.is_cpu and k.is_cpu)
            or _grad_enabled() and (q.requires_grad or k.requires_grad)):
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
    if len(rows_shape) == 1 and rows_shape[0] == t:
        rows_b = 0
    elif len(rows_shape) == 2 and rows_shape[1] == t and rows_shape[0] in (1, b):
        rows_b = t if rows_shape[0] > 1 else 0
    else:
        return None
    code = cpu.DTYPES.get(dtype)  # the C side refuses a dtype it was built without (float16)
    run = cpu.entry(dtype) if fresh is None else fresh[0]
    if code is None or run is None:
        return None
    try:
        qp, kp, q4, k4 = q.data_ptr(), k.data_ptr(), q.stride(), k.stride()  # layout's dims
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
    threads = _num_threads()
    # RopeArgs' fields, then (no table) AnglesArgs' with the same thread count, in one buffer
    pack, tail = (cpu.pack_args, ()) if fresh is None else (angles.pack_fresh, (*fresh[1], threads))
    ret = run(pack(qp, qop, kp, kop, cos, sin, rows_address, b, hq, hk, t, d, *q4, *qo4, *k4, *ko4, n, half, rows_b,
                   code, pairing, threads, flags, *tail))
    if ret != 0:
        return None  # nothing written: the general path names what is wrong (or rotates aliasing-free views)
    if inplace:  # the kernel wrote through ctypes: tell autograd, as a torch in-place op would
        _increment_version((q, k))
    return q_out, k_out
