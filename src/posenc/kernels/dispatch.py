"""Route `Rope.apply` / `Rope.apply_` / `Rope.rotate` to an implementation, with tables cached per Rope.

Hot path (CPU, eager, no autograd): the shape checks of `Rope`, one dictionary look-up for the cached
cos/sin table of this Rope, one call of the C kernel that checks the positions (>= 0, inside the table)
while it reads them: no host sync, no temporary. Tables are rows `[n, r/2]` of `Rope.cos_sin(arange(n))`,
bit-identical to the rows `cos_sin(position_ids)` computes (torch's float32 cos/sin do not depend on
where an element sits in the tensor; tests/test_kernels.py checks it).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import TYPE_CHECKING

import torch

from ..errors import Raw, check_int_positions, fail
from ..rope.apply import LAYOUTS, apply_rope
from . import IMPLS, cpu

if TYPE_CHECKING:
    from ..rope.spec import Rope

__all__ = ["resolve_impl", "rope_apply", "table_rows", "fast_key", "fast_apply", "aliased"]

_TABLES: dict = {}  # (rope, precision, seq_len, device) -> (cos, sin), each [n, r/2] float32
_MAX_TABLES = 16
_CPU_OK: dict = {}  # dtype -> whether the C kernel runs it (built once per process)
_FAST = threading.local()  # .calls: {fast_key: (packed arguments, kernel, their address, cos, sin)}, per thread
_NO_CALLS: dict = {}
_MAX_FAST = 64
_MAX_TABLE_ROWS = 1 << 20  # beyond this, per-call tables (a [2**20, 64] pair of tables is 512 MiB)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def resolve_impl(impl: str | None, x: torch.Tensor, compute_dtype: torch.dtype | None) -> str:
    """The implementation to run: `impl` checked, or the fastest available for `x` when None.

    Raises:
        PosencError: an unknown name, or a named implementation that cannot run these inputs.
    """
    if impl is None and compute_dtype is None and x.device.type == "cpu" and not _compiling():
        ok = _CPU_OK.get(x.dtype)  # the decode hot path: one dict look-up
        if ok is None:
            ok = _CPU_OK[x.dtype] = cpu.available(x.dtype)
        return "cpu" if ok else "reference"
    default_compute = compute_dtype is None or compute_dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    if impl is None:
        if not default_compute or _compiling():  # under torch.compile inductor fuses the reference itself
            return "reference"
        if x.device.type == "cpu":
            return "cpu" if cpu.available(x.dtype) else "reference"
        if x.device.type == "cuda" and triton_available():
            return "triton"
        return "reference"
    if impl not in IMPLS:
        fail("impl", f"None or one of {IMPLS}", impl)
    if impl == "reference" or impl == "compiled":
        return impl
    if not default_compute:
        fail("impl", f"'reference' or 'compiled' for compute_dtype={compute_dtype}", impl)
    if _compiling():
        return impl  # traced: the custom op's implementation says at run time if its kernel cannot build
    if impl == "cpu":
        if x.device.type != "cpu":
            fail("impl", f"'cpu' with CPU tensors (q is on {x.device})", impl)
        if not cpu.available(x.dtype):
            cpu.require(x.dtype)  # raises, saying why
    elif impl == "triton":
        if not triton_available():
            fail("impl", "'triton' with the triton package installed (pip install posenc[triton])", impl)
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            fail("impl", f"'triton' with CUDA tensors (q is on {x.device}; TRITON_INTERPRET=1 runs it on CPU)", impl)
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            fail("impl", f"'triton' with float32, bfloat16 or float16 (got {x.dtype})", impl)
    return impl


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def table_rows(rope: "Rope", n: int, precision: str, seq_len: int | None, device: torch.device):
    """Cached `(cos, sin)` rows for positions `0 .. n'-1` (n' >= n, a power of two), each `[n', r/2]` float32."""
    key = (rope, precision, seq_len, device)
    hit = _TABLES.get(key)
    if hit is not None and hit[0].shape[0] >= n:
        return hit
    rows = max(4096, 1 << max(n - 1, 1).bit_length())
    positions = torch.arange(rows, device=device)
    inv, factor = rope.inv_freq(seq_len)
    from ..rope import tables

    cos, sin = tables.cos_sin(positions, inv, factor, precision)  # [rows, r/2]
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = (cos, sin)
    return cos, sin


def fast_key(rope: "Rope", q, k, position_ids, inplace: bool, layout, seq_len, precision, allow_negative,
             compute_dtype, impl):
    """The key under which a repeated `Rope.apply(_)` call may skip its checks, or None when it may not.

    A key holds everything the checks and the kernel's arguments depend on except the data: the Rope,
    the options and the shapes, strides, dtypes and devices of q, k and the positions. `rope_apply`
    records the packed kernel arguments under it after a checked call ran the C kernel; `fast_apply`
    then only rewrites the data pointers (the decode hot path: ~2 us of Python instead of ~9 us).
    """
    if (seq_len is not None or compute_dtype is not None or type(allow_negative) is not bool
            or type(layout) is not str or type(precision) is not str or (impl is not None and impl != "cpu")
            or type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(position_ids) is not torch.Tensor
            or position_ids.dtype != torch.int64 or _compiling()
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
        return None
    return (rope, inplace, layout, precision, allow_negative, impl, q.shape, q.stride(), q.dtype, q.device,
            k.shape, k.stride(), k.dtype, k.device, position_ids.shape, position_ids.stride(), position_ids.device)


def fast_apply(key, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, inplace: bool):
    """`(q_rotated, k_rotated)` through the kernel arguments recorded under `key`, or None (not recorded, q and
    k aliased in place, or the kernel declined these positions: nothing was written, the checked path takes over)."""
    entry = _FAST.__dict__.get("calls", _NO_CALLS).get(key)
    if entry is None:
        return None
    args, kernel, address, (q_end, k_end) = entry[0], entry[1], entry[2], entry[5]
    qp, kp = q.data_ptr(), k.data_ptr()
    if inplace and qp < kp + k_end and kp < qp + q_end and aliased(q, k):
        return None  # the checked path refuses it
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))  # strides as recorded
    args[0], args[1], args[2], args[3] = qp, q_out.data_ptr(), kp, k_out.data_ptr()
    args[30] = position_ids.data_ptr()
    if kernel(address) != 0:
        del _FAST.calls[key]  # e.g. a position beyond the table: recorded again once the table has grown
        return None
    return q_out, k_out


def _extent(shape, stride, elem: int) -> int:
    """Bytes from a tensor's first element to one past its last (0 when it has no elements)."""
    if 0 in shape:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride))) * elem


def aliased(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether rotating q and k in place would write some memory twice.

    True when q or k has a broadcast (stride-0) dimension, or when some element of q is an element of k:
    decided exactly when their memory ranges meet and they have the same sizes and strides (views of one
    buffer, e.g. q and k split from a fused qkv projection: disjoint), else taken as disjoint when the
    ranges do not meet, and as aliased when they do.
    """
    for x in (q, k):
        if any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride())):
            return True
    q_end, k_end = _extent(q.shape, q.stride(), q.element_size()), _extent(k.shape, k.stride(), k.element_size())
    qp, kp = q.data_ptr(), k.data_ptr()
    if not q_end or not k_end or qp >= kp + k_end or kp >= qp + q_end:
        return False
    if q.shape != k.shape or q.stride() != k.stride() or q.element_size() != k.element_size():
        return True  # ranges meet and the layouts differ: not worth deciding
    delta = abs(kp - qp)  # bytes: is it the offset of some element of q (an index vector within the sizes)?
    for n, st in sorted(zip(q.shape, q.stride()), key=lambda d: -d[1]):
        step = st * q.element_size()
        if step:
            m = min(delta // step, n - 1)
            delta -= m * step
    return delta == 0


def _remember(key, args, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Record packed kernel arguments under `key` for `fast_apply` (holding the tables they point to), with the
    bytes q and k span (views of the call's q and k: the same memory)."""
    calls = _FAST.__dict__.setdefault("calls", {})
    if len(calls) >= _MAX_FAST:
        calls.pop(next(iter(calls)))
    extents = tuple(_extent(x.shape, x.stride(), x.element_size()) for x in (q, k))
    calls[key] = (args, cpu.require(q.dtype).posenc_rope_packed, ctypes.addressof(args), cos, sin, extents)


def _view4(x: torch.Tensor, layout: str) -> torch.Tensor:
    """`x` as a `[b, h, t, d]` view (no copy) from any supported layout."""
    if layout == "bthd":
        return x.transpose(1, 2)  # [b, h, t, d]
    if layout == "thd":
        return x.unsqueeze(0).transpose(1, 2)  # [1, h, t, d]
    return x


def _per_call_tables(rope: "Rope", position_ids: torch.Tensor, seq_len, precision: str, allow_negative: bool):
    """`(cos, sin, rows)`: tables `[n, r/2]` computed for these positions, rows `[t]` or `[b, t]` into them."""
    # Under torch.compile the sign check (a host sync) is skipped: negative positions rotate backwards.
    cos, sin = rope.cos_sin(position_ids, seq_len=seq_len, precision=precision,
                            allow_negative=allow_negative or _compiling())  # [t, r/2] or [b, t, r/2]
    t = cos.shape[-2]
    rows = torch.arange(cos.shape[:-1].numel(), device=cos.device)  # [b * t] or [t]
    rows = rows.view(-1, t) if cos.ndim == 3 else rows  # [b, t] or [t]
    return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]), rows  # [n, r/2]


def _cpu_cached(rope, q4, k4, qo4, ko4, position_ids, seq_len, precision, allow_negative, memo=None) -> bool:
    """Eager CPU fast path on the cached table; False when these positions need per-call tables.

    `memo`: a `fast_key` under which to record the kernel's arguments when it ran on these very positions.
    """
    if position_ids.device.type != "cpu":
        fail("position_ids", "a tensor on the device of q (cpu)", position_ids)
    if position_ids.dtype != torch.int64:
        check_int_positions("position_ids", position_ids, allow_negative=True)  # rejects non-integer dtypes
        position_ids = position_ids.long()
    rows = position_ids.contiguous()  # [t] or [b, t]
    cos, sin = table_rows(rope, 0, precision, seq_len, q4.device)
    for _ in range(2):  # the second try runs on a table grown to cover every row
        ret = cpu.rotate(q4, k4, qo4, ko4, cos, sin, rows, rope.pairing)
        if ret == 0:
            if memo is not None and k4 is not None and rows is position_ids and rows.numel():
                _remember(memo, cpu.pack(q4, k4, qo4, ko4, cos, sin, rows, rope.pairing), q4, k4, cos, sin)
            return True
        if ret < 0 or ret > _MAX_TABLE_ROWS:
            break
        cos, sin = table_rows(rope, ret, precision, seq_len, q4.device)
    if ret < 0 and not allow_negative:
        check_int_positions("position_ids", position_ids)  # raises: negative positions
    return False  # negative positions (allowed) or beyond the largest cached table


def rope_apply(rope: "Rope", q: torch.Tensor, k: torch.Tensor | None, position_ids: torch.Tensor, *, inplace: bool,
               impl: str | None, layout: str, seq_len: int | None, precision: str, allow_negative: bool,
               compute_dtype: torch.dtype | None, memo=None):
    """Rotate q (and k) with the chosen implementation; the arguments are `Rope.apply`'s, already checked.

    `memo`: the call's `fast_key` (or None), under which the CPU kernel's arguments are recorded.

    Returns:
        `(q_rotated, k_rotated)` (k_rotated None when k is None): q and k themselves when `inplace`.
    """
    name = resolve_impl(impl, q, compute_dtype)
    if name == "cpu" and not cpu.fits(rope.rotary_dim, rope.head_dim):
        if impl is not None:
            fail("impl", f"'cpu' with rotary_dim <= {cpu.MAX_ROTARY_DIM} and head_dim <= {cpu.MAX_HEAD_DIM}",
                 Raw(f"rotary_dim {rope.rotary_dim}, head_dim {rope.head_dim}"))
        name = "reference"  # the default: the reference handles any width
    xs = [x for x in (q, k) if x is not None]
    if name in ("reference", "compiled"):
        cos, sin = rope.cos_sin(position_ids, seq_len=seq_len, precision=precision,
                                allow_negative=allow_negative or _compiling())
        if name == "compiled":
            from .compiled import apply_rope_compiled as fn
        else:
            fn = apply_rope
        outs = [fn(x, cos, sin, pairing=rope.pairing, layout=layout, compute_dtype=compute_dtype) for x in xs]
        if inplace:
            outs = [x.copy_(o) for x, o in zip(xs, outs)]
        return outs[0], outs[1] if k is not None else None

    if k is not None and k.dtype != q.dtype:  # one kernel call per dtype
        args = dict(inplace=inplace, impl=name, layout=layout, seq_len=seq_len, precision=precision,
                    allow_negative=allow_negative, compute_dtype=compute_dtype)
        return rope_apply(rope, q, None, position_ids, **args)[0], rope_apply(rope, k, None, position_ids, **args)[0]
    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    q4 = _view4(q, layout)  # [b, hq, t, d]
    k4 = _view4(k, layout) if k is not None else q4[:, :0]  # [b, hk, t, d]; no heads when k is None
    if name == "cpu" and not grad and not _compiling() and position_ids.ndim <= 2 and (
        seq_len is not None or not rope.scaling.depends_on_length
    ):
        outs = xs if inplace else [torch.empty_like(x) for x in xs]
        k_out = _view4(outs[1], layout) if k is not None else None
        if _cpu_cached(rope, q4, k4 if k is not None else None, _view4(outs[0], layout), k_out, position_ids,
                       seq_len, precision, allow_negative, memo):
            return outs[0], outs[1] if k is not None else None

    cos, sin, rows = _per_call_tables(rope, position_ids, seq_len, precision, allow_negative)
    from . import ops

    if inplace and not grad and not (name == "triton" and rope.pairing == "interleaved_to_split_half"):
        ops.rope_(q4, k4, cos, sin, rows, rope.pairing, name, "table", 1.0)
        return q, k
    q_out, k_out = ops.rope(q4, k4, cos, sin, rows, rope.pairing, name, False, "table", 1.0)  # [b, h, t, d]
    q_out, k_out = _unview4(q_out, layout), _unview4(k_out, layout) if k is not None else None
    if inplace:  # autograd records the copies (or the in-place kernel cannot run in place)
        return q.copy_(q_out), k.copy_(k_out) if k is not None else None
    return q_out, k_out


def _unview4(x4: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of `_view4`."""
    if layout == "bthd":
        return x4.transpose(1, 2)  # [b, t, h, d]
    if layout == "thd":
        return x4.transpose(1, 2).squeeze(0)  # [t, h, d]
    return x4


def apply_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, pairing: str,
                 layout: str = "bhtd") -> torch.Tensor:
    """`apply_rope(x, cos, sin, pairing=, layout=)`, through the C kernel where that is exact and available.

    Used by the decoder, which builds one set of per-token tables per step for all layers.
    """
    from ..rope.apply import check_table

    fast = (x.device.type == "cpu" and layout in ("bhtd", "bthd", "thd") and not _compiling()
            and not (torch.is_grad_enabled() and x.requires_grad) and cos.dtype == sin.dtype == torch.float32
            and cpu.fits(2 * cos.shape[-1], x.shape[-1]) and cpu.available(x.dtype))
    if not fast:
        return apply_rope(x, cos, sin, pairing=pairing, layout=layout)
    check_table(cos, sin, x, layout)
    t = x.shape[LAYOUTS[layout][1]]
    n_tab = cos.shape[-2]  # t or 1 (broadcast)
    rows = torch.arange(cos.shape[:-1].numel()).view(-1, n_tab)  # [b? or 1, n_tab]
    rows = rows.expand(-1, t) if n_tab == 1 else rows  # [b? or 1, t]
    out = torch.empty_like(x)
    ret = cpu.rotate(_view4(x, layout), None, _view4(out, layout), None, cos.reshape(-1, cos.shape[-1]).contiguous(),
                     sin.reshape(-1, sin.shape[-1]).contiguous(), rows.contiguous(), pairing)
    if ret != 0:  # rows index the tables they were made from
        raise RuntimeError(f"posenc cpu kernel rejected the table rows (code {ret})")
    return out
