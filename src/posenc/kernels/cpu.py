"""Launcher of the C RoPE kernel (`rope_cpu.c`, `rope_tile.c`, `rope_pool.c` and their headers, beside this
file), called through ctypes: a leaf.

The kernel takes tensors and nothing else: q and k (`[b, h, t, d]` views, any strides), their outputs
(which may be q and k themselves), per-pair float32 tables `cos`/`sin` `[n, r/2]`, the table row of each
token, and the pairing. It rotates q and k in one call on up to `torch.get_num_threads()` threads (the C
library's worker pool, started once: `pool_workers`), reading each element once and writing it once, with
the reference's arithmetic (bit-identical results, see the C file). It checks the rows itself (no host sync
in Python) and writes nothing when one is out of range (or, with `FLAG_CHECK_OVERLAP`, when q's and k's
memory ranges meet).

A caller asks one question, `entry(dtype)`: the kernel's foreign function when it runs that dtype here, else
None; then it calls it (the decode hot path, `posenc.rope.dispatch.rotate_held`, packs the struct itself) or
passes it to `rope(..., run=)`. `unavailable()` says why there is none, for an error message.

The arguments travel as one C struct, `RopeArgs`, mirrored by the `ctypes.Structure` below; the call packs
it with a precompiled `struct.Struct` (about 1 us, against about 7 us for building the ctypes object).
Building and loading the library is `build.py`'s job.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct

import torch

from . import build
from .constants import DTYPE_CODES as DTYPES, MAX_HEAD_DIM, MAX_ROTARY_DIM, PAIRING_CODES, fits

__all__ = ["entry", "unavailable", "available", "rope", "advise_huge_pages", "fits", "RopeArgs", "DTYPES",
           "PAIRING_CODES", "MAX_ROTARY_DIM", "MAX_HEAD_DIM", "BAD_ARGUMENTS", "OVERLAP", "FLAG_HUGE_PAGES",
           "FLAG_CHECK_OVERLAP", "pack_args", "ARGS_FORMAT", "huge_pages_allowed", "pool_workers", "pool_openmp"]

BAD_ARGUMENTS = -(1 << 62)  # the kernel's answer to arguments it cannot take
OVERLAP = BAD_ARGUMENTS + 1  # its answer, with FLAG_CHECK_OVERLAP, to q and k whose memory ranges meet
FLAG_HUGE_PAGES = 1  # RopeArgs.flags: advise huge pages on fresh outputs of >= 4 MiB
FLAG_CHECK_OVERLAP = 2  # RopeArgs.flags: return OVERLAP (nothing written) when q's and k's memory ranges meet
LARGE_OUTPUT_BYTES = 4 << 20  # rope_tile.h's threshold for huge pages


class RopeArgs(ctypes.Structure):
    """`RopeArgs` of rope_cpu.c, field for field (tests/kernels/test_cpu.py checks the layout against the C side)."""

    _fields_ = [("q", ctypes.c_void_p), ("q_out", ctypes.c_void_p), ("k", ctypes.c_void_p),
                ("k_out", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("batch", ctypes.c_int64), ("q_heads", ctypes.c_int64),
                ("k_heads", ctypes.c_int64), ("tokens", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("q_strides", ctypes.c_int64 * 4), ("q_out_strides", ctypes.c_int64 * 4),
                ("k_strides", ctypes.c_int64 * 4), ("k_out_strides", ctypes.c_int64 * 4),
                ("table_rows", ctypes.c_int64), ("half", ctypes.c_int64), ("rows_batch_stride", ctypes.c_int64),
                ("dtype", ctypes.c_int32), ("pairing", ctypes.c_int32), ("threads", ctypes.c_int32),
                ("flags", ctypes.c_int32)]


_CODE = {ctypes.c_void_p: "Q", ctypes.c_int64: "q", ctypes.c_int32: "i"}


def _format(fields) -> str:
    """The `struct` format of a ctypes field list (no padding: every field is aligned by construction)."""
    out = "="
    for _, kind in fields:
        out += f"{kind._length_}{_CODE[kind._type_]}" if hasattr(kind, "_length_") else _CODE[kind]
    return out


ARGS_FORMAT = _format(RopeArgs._fields_)  # RopeArgs' `struct` format (angles.py appends AnglesArgs' to it)
_PACK = struct.Struct(ARGS_FORMAT).pack  # a constant: the packer of RopeArgs
assert struct.calcsize(ARGS_FORMAT) == ctypes.sizeof(RopeArgs)
pack_args = _PACK  # RopeArgs' fields, in order, as the bytes `posenc_rope` takes


@functools.lru_cache(maxsize=None)  # a pure function of the loaded library: its declared entry points
def _declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.posenc_rope.restype = ctypes.c_int64
    lib.posenc_rope.argtypes = [ctypes.c_char_p]
    lib.posenc_args_size.restype = ctypes.c_int64
    lib.posenc_has_f16.restype = ctypes.c_int
    lib.posenc_advise_huge_pages.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.posenc_pool_workers.restype = ctypes.c_int64
    lib.posenc_pool_openmp.restype = ctypes.c_int64
    return lib


def _lib() -> ctypes.CDLL | str:
    lib = build.library()
    return lib if isinstance(lib, str) else _declared(lib)


@functools.lru_cache(maxsize=None)  # a pure function of the loaded library (tests that reload it clear both)
def entry(dtype: torch.dtype):
    """`posenc_rope`, the kernel's foreign function (packed `RopeArgs` bytes -> int64), when it runs `dtype` here;
    else None. The one question a caller asks before it calls the kernel."""
    lib = build.loaded()
    if lib is None or dtype not in DTYPES:
        return None
    lib = _declared(lib)
    return lib.posenc_rope if dtype is not torch.float16 or lib.posenc_has_f16() else None


def unavailable() -> str | None:
    """Why the library is not there (the build's message), or None when it is: then a None `entry(dtype)` means
    the dtype (float32, bfloat16, float64, and float16 where the compiler has _Float16). For error messages."""
    lib = build.library()
    return lib if isinstance(lib, str) else None


def available(dtype: torch.dtype | None = None) -> bool:
    """True when the kernel builds (or is built) here and supports `dtype` (any supported dtype if None)."""
    if dtype is None:
        return not isinstance(build.library(), str)
    return entry(dtype) is not None


def rope(
    q: torch.Tensor, k: torch.Tensor | None, q_out: torch.Tensor, k_out: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, pairing: str, *, run=None,
) -> int:
    """Rotate q (and k) into q_out (and k_out), which may be q and k themselves.

    Args:
        q, q_out: `[b, hq, t, d]` views (any strides) on the CPU; k, k_out: `[b, hk, t, d]` or None.
        cos, sin: contiguous float32 tables `[n, r/2]`.
        rows: contiguous int64 `[t]` or `[b, t]`: the table row of each token.
        pairing: a name from `PAIRING_CODES`.
        run: `entry(q.dtype)`, when the caller already holds it (default: asked here; a dtype the kernel
            cannot run here is a bug of the caller, which asked `entry` first).
    Returns:
        0 when done; otherwise nothing was written and the value says why: `BAD_ARGUMENTS`, arguments the
        kernel cannot take; < 0, the most negative row; > 0, the table length the rows need.
    """
    if run is None:
        run = entry(q.dtype)
        if run is None:
            raise RuntimeError(f"posenc cpu kernel cannot run {q.dtype} here ({unavailable() or 'the dtype'})")
    if rows.numel() == 0:  # no tokens or no batch rows: nothing to do (and no row to read)
        return 0
    b, hq, t, d = q.shape
    qs, qp, qop = q.stride(), q.data_ptr(), q_out.data_ptr()
    qos = qs if qop == qp else q_out.stride()
    if k is None:
        k_ptr = k_out_ptr = hk = 0
        ks = kos = qs
    else:
        ks, k_ptr, k_out_ptr, hk = k.stride(), k.data_ptr(), k_out.data_ptr(), k.shape[1]
        kos = ks if k_out_ptr == k_ptr else k_out.stride()
    fresh = qop != qp or k_out_ptr != k_ptr  # a fresh output: huge pages may be advised on a large one
    large = fresh and b * (hq + hk) * t * d * q.element_size() >= LARGE_OUTPUT_BYTES
    args = _PACK(qp, qop, k_ptr, k_out_ptr, cos.data_ptr(), sin.data_ptr(), rows.data_ptr(),
                 b, hq, hk, t, d, *qs, *qos, *ks, *kos, cos.shape[0], cos.shape[1],
                 t if rows.ndim == 2 and rows.shape[0] > 1 else 0, DTYPES[q.dtype], PAIRING_CODES[pairing],
                 torch.get_num_threads(), FLAG_HUGE_PAGES if large and huge_pages_allowed() else 0)
    return run(args)


def huge_pages_allowed() -> bool:
    """Whether the kernel may advise huge pages on fresh outputs (not with `POSENC_HUGE_PAGES=0`)."""
    return os.environ.get("POSENC_HUGE_PAGES", "1") != "0"


def pool_workers() -> int:
    """How many worker threads the C library has started (its pool: see "Every core" in docs/performance.md)."""
    lib = _lib()
    return 0 if isinstance(lib, str) else lib.posenc_pool_workers()


def pool_openmp() -> bool:
    """Whether calls with more than one thread run on the OpenMP team torch uses (a build with OpenMP, not in a
    forked child), rather than on the library's own pthread pool."""
    lib = _lib()
    return False if isinstance(lib, str) else bool(lib.posenc_pool_openmp())


def advise_huge_pages(x: torch.Tensor) -> torch.Tensor:
    """Ask for transparent huge pages on a fresh CPU tensor's memory before its first write (as the kernel does
    for its own outputs of >= 4 MiB; a hint, nothing without Linux THP or with `POSENC_HUGE_PAGES=0`). Returns x."""
    lib = _lib()
    if not isinstance(lib, str) and x.device.type == "cpu" and os.environ.get("POSENC_HUGE_PAGES", "1") != "0":
        lib.posenc_advise_huge_pages(x.data_ptr(), x.numel() * x.element_size())
    return x
