"""Launcher of the C RoPE kernel (`rope_cpu.c`, beside this file): built on first use, called through ctypes.

The kernel rotates q and k in one call, in place or into output buffers, reading each element once
and writing it once, with the reference's arithmetic (bit-identical results, see the C file). It is
compiled lazily with the system C compiler (`$CC`, else gcc, cc or clang) into a per-user cache
(`$POSENC_CACHE_DIR`, else `$XDG_CACHE_HOME/posenc` or `~/.cache/posenc`), keyed by the source, the
flags and the CPU, so a fresh machine builds it once (well under a second) and never again.

A plain shared library rather than a torch C++ extension: it needs no torch headers (a torch
extension takes ~1 min to build on a 2-core machine), and the call costs a few microseconds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..errors import Raw, fail

__all__ = ["available", "rotate", "pack", "call", "advise_huge_pages", "fits", "DTYPES", "PAIRING_CODES",
           "MAX_ROTARY_DIM", "MAX_HEAD_DIM"]

PAIRING_CODES = {"split_half": 0, "interleaved": 1, "interleaved_to_split_half": 2}
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_READY: dict = {}  # dtype -> the loaded library, once `require` accepted it
MAX_ROTARY_DIM, MAX_HEAD_DIM = 2048, 4096  # rope_cpu.c's row buffers: MAX_HALF pairs, 2 * MAX_HALF + 2048 channels
_FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11"]  # no FMA: bit-exact vs the reference


def _cache_dir() -> Path:
    root = os.environ.get("POSENC_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posenc" / "kernels"


def _target(name: str) -> Path | str:
    """Where the built library `name` is or goes: the cache folder (`_cache_dir`), or, when that cannot be
    created (a read-only home in a container, a path through a file), a per-user folder in the temp
    directory; a string saying why when neither can."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    tried = []
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"posenc-{uid}" / "kernels"):
        if (folder / name).exists():
            return folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            tried.append(f"{folder}: {exc.strerror or exc}")
            continue
        if os.access(folder, os.W_OK):
            return folder / name
        tried.append(f"{folder}: not writable")
    return "no writable folder for the built kernel (set POSENC_CACHE_DIR): " + "; ".join(tried)


def _cpu_signature() -> str:
    try:  # -march=native output depends on the CPU: key the cache on its flags
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(cc: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        errors = []
        for arch in (["-march=native"], []):  # some compilers (or CPUs) reject -march=native
            proc = subprocess.run([cc, *_FLAGS, *arch, "-o", str(out), str(source)], capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(out, target)  # atomic: concurrent builders never see a half-written library
                return
            errors.append(proc.stderr.strip()[-400:])
        raise OSError(" / ".join(errors))


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | str:
    """The loaded kernel library, or a string saying why it cannot be built."""
    source = Path(__file__).with_name("rope_cpu.c")
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if not cc:
        return "no C compiler found (set $CC or install gcc)"
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(_FLAGS).encode(), cc.encode(),
                                     platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:16]
    target = _target(f"rope_cpu-{key}.so")
    if isinstance(target, str):
        return target
    try:
        if not target.exists():
            _compile(cc, source, target)
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return f"building {source.name} with {cc} failed: {exc}"
    f = lib.posenc_rope_flat
    f.restype = ctypes.c_int64
    f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 21 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                                  ctypes.c_int64, ctypes.c_int]
    lib.posenc_rope_packed.restype = ctypes.c_int64
    lib.posenc_rope_packed.argtypes = [ctypes.c_void_p]
    lib.posenc_has_f16.restype = ctypes.c_int
    lib.posenc_set_huge_pages.argtypes = [ctypes.c_int]
    lib.posenc_advise_huge_pages.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.posenc_set_huge_pages(os.environ.get("POSENC_HUGE_PAGES", "1") != "0")
    return lib


def available(dtype: torch.dtype | None = None) -> bool:
    """True when the kernel builds (or is built) here and supports `dtype` (any supported dtype if None)."""
    lib = _library()
    if isinstance(lib, str):
        return False
    return dtype is None or dtype in DTYPES and (dtype != torch.float16 or bool(lib.posenc_has_f16()))


def fits(rotary_dim: int, head_dim: int) -> bool:
    """Whether the kernel's row buffers hold rows this wide (larger ones run on the reference)."""
    return rotary_dim <= MAX_ROTARY_DIM and head_dim <= MAX_HEAD_DIM


def require(dtype: torch.dtype) -> ctypes.CDLL:
    """The library, or `PosencError` naming impl 'cpu' and why it cannot run."""
    lib = _library()
    if isinstance(lib, str):
        fail("impl", "'cpu' to be buildable", Raw(lib))
    if not available(dtype):
        fail("impl", "'cpu' with float32, bfloat16, float64 or float16 (where the compiler has _Float16)", Raw(str(dtype)))
    return lib


_Args = ctypes.c_int64 * 33  # posenc_rope_flat's arguments; slots 0-3: q, q_out, k, k_out; 30: rows


def pack(
    q: torch.Tensor, k: torch.Tensor | None, q_out: torch.Tensor, k_out: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, pairing: str,
) -> ctypes.Array:
    """The kernel's arguments for these tensors as one int64 array (see `rotate` for the arguments).

    A caller may keep the array and rewrite only the data pointers in slots 0-3 (q, q_out, k, k_out)
    and 30 (rows) for tensors of the same shapes and strides; cos and sin must stay alive meanwhile.
    """
    if k is None:
        k_args = (0, 0, 0, *q.stride(), *q.stride())
    else:
        k_args = (k.data_ptr(), k_out.data_ptr(), k.shape[1], *k.stride(), *k_out.stride())
    b, hq, t, d = q.shape
    return _Args(q.data_ptr(), q_out.data_ptr(), k_args[0], k_args[1], b, hq, k_args[2], t, d, *q.stride(),
                 *q_out.stride(), *k_args[3:], DTYPES[q.dtype], cos.data_ptr(), sin.data_ptr(), cos.shape[0],
                 cos.shape[1], rows.data_ptr(), rows.shape[-1] if rows.ndim == 2 and rows.shape[0] > 1 else 0,
                 PAIRING_CODES[pairing])


def call(args: ctypes.Array, dtype: torch.dtype) -> int:
    """Run the kernel on packed arguments (`pack`); returns as `rotate`."""
    lib = _READY.get(dtype) or _READY.setdefault(dtype, require(dtype))  # checked once per dtype
    return lib.posenc_rope_packed(ctypes.addressof(args))


def rotate(
    q: torch.Tensor, k: torch.Tensor | None, q_out: torch.Tensor, k_out: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, pairing: str,
) -> int:
    """Rotate q (and k) into q_out (and k_out), which may be q and k themselves.

    Args:
        q, q_out: `[b, hq, t, d]` views (any strides) on the CPU; k, k_out: `[b, hk, t, d]` or None.
        cos, sin: contiguous float32 tables `[n, r/2]`.
        rows: contiguous int64 `[t]` or `[b, t]`: the table row of each token.
        pairing: a name from `PAIRING_CODES`.
    Returns:
        0 when done; otherwise nothing was written and the value says why: < 0, the most negative row;
        > 0, the table length the rows need.
    """
    if rows.numel() == 0:  # no tokens or no batch rows: nothing to do (and no row to read)
        require(q.dtype)
        return 0
    return call(pack(q, k, q_out, k_out, cos, sin, rows, pairing), q.dtype)


def advise_huge_pages(x: torch.Tensor) -> torch.Tensor:
    """Ask for transparent huge pages on a fresh CPU tensor's memory before its first write (as the kernel does
    for its own outputs of >= 4 MiB; a hint, nothing without Linux THP or with `POSENC_HUGE_PAGES=0`). Returns x."""
    lib = _library()
    if not isinstance(lib, str) and x.device.type == "cpu":
        lib.posenc_advise_huge_pages(x.data_ptr(), x.numel() * x.element_size())
    return x
