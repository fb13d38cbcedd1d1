"""cos/sin rows of a few positions in one C call (`rope_angles.c`), bit-identical to torch's float32 formula
`cos(float(p) * freq) * factor` (and sin): a leaf, like `cpu.py`.

torch's float32 cos and sin on contiguous CPU memory are MKL's vector math where torch is built with MKL
(`vmsCos` / `vmsSin`, exported by the torch library, called with torch's mode: high accuracy, denormals
kept, errors ignored); the C side is handed those very functions, so each angle takes the same code as in
`torch.cos`. `entry()` says whether this path runs here: the kernel library is built, the functions are
found, and a probe of 74,000 angles (positions of every magnitude up to 2**40, both signs, with and without
an attention factor) gives torch's bits exactly. Anywhere else (a torch without MKL: SLEEF's functions) it
is None and the caller makes the angles with torch's three ops (`rope.tables.float32_cos_sin`).

    >>> import torch
    >>> from posenc.kernels import angles
    >>> run = angles.entry()
    >>> pos, freq = torch.tensor([3, 4095]), torch.tensor([1.0, 0.01, 1e-4])
    >>> if run is not None:
    ...     cos, sin = angles.cos_sin(run, pos, freq, 1.0, 0, 2**53)
    ...     theta = pos[:, None] * freq
    ...     assert torch.equal(cos, theta.cos()) and torch.equal(sin, theta.sin())
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct

import torch

from . import build
from .cpu import ARGS_FORMAT

__all__ = ["entry", "cos_sin", "pack", "pack_fresh", "LIMIT", "MODE", "OUT_OF_RANGE"]

# AnglesArgs of rope_angles.c: positions, freq, cos, sin, vcos, vsin, local_threads (pointers), n, half, mode,
# low, high, factor, scale, threads
_FORMAT = "=7Q5qfiq"
pack = struct.Struct(_FORMAT).pack
# posenc_rope_fresh's one buffer: RopeArgs' fields, then AnglesArgs' (both 8-byte multiples: no padding between)
pack_fresh = struct.Struct(ARGS_FORMAT + _FORMAT[1:]).pack
# torch's MKL mode (ATen/cpu/vml.h): VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
MODE = 0x2 | 0x140000 | 0x100
OUT_OF_RANGE = -2  # posenc_angles' answer to a position outside [low, high] (nothing written)
LIMIT = 1 << 24  # angles (positions x r/2) one call makes (64 MiB of cos rows); more take torch's ops


@functools.lru_cache(maxsize=None)  # a pure function of the loaded libraries (the kernel's and torch's)
def entry():
    """`(posenc_angles, vcos, vsin, posenc_rope_fresh, local_threads)`: the C functions (the angles alone; the
    angles then the rotation, `rope/fast.py`), torch's vector cos/sin and MKL's `MKL_Set_Num_Threads_Local` (0
    where absent: the C side turns MKL's own threading off inside its parallel parts), or None where this path
    does not give torch's bits here (see the module's text)."""
    lib = build.loaded()
    if lib is None or not hasattr(lib, "posenc_angles") or not torch.backends.mkl.is_available():
        return None
    try:
        mkl = ctypes.CDLL(_torch_cpu_library())
        vcos = ctypes.cast(mkl.vmsCos, ctypes.c_void_p).value
        vsin = ctypes.cast(mkl.vmsSin, ctypes.c_void_p).value
        local = ctypes.cast(getattr(mkl, "MKL_Set_Num_Threads_Local", None), ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return None
    fn, fresh = lib.posenc_angles, lib.posenc_rope_fresh
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_char_p]
    fresh.restype, fresh.argtypes = ctypes.c_int64, [ctypes.c_char_p]
    lib.posenc_angles_args_size.restype = ctypes.c_int64
    if lib.posenc_angles_args_size() != struct.calcsize(_FORMAT):
        return None
    run = (fn, vcos, vsin, fresh, local)
    with torch._C._DisableFuncTorch(), torch.no_grad():  # the probe's own tensors, whatever transform is active
        return run if _probe(run) else None


def _torch_cpu_library() -> str:
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = [n for n in os.listdir(folder) if n.startswith("libtorch_cpu.")]
    if not names:
        raise OSError(f"no libtorch_cpu in {folder}")
    return os.path.join(folder, sorted(names)[0])


def _probe(run) -> bool:
    """Whether the C angles are torch's, bit for bit, on positions of every magnitude (0 to 2**40, negative
    too) against a frequency ladder with an attention factor and without."""
    g = torch.Generator().manual_seed(0)
    pos = torch.cat((torch.arange(-64, 1024), torch.randint(-(2**40), 2**40, (1024,), generator=g)))  # [2112]
    freq = torch.cat((10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64), torch.rand(3, generator=g)))
    for factor in (1.0, 1.1951):
        theta = pos[:, None] * freq  # [n, 35]
        cos, sin = cos_sin(run, pos, freq, factor, -(2**41), 2**41)
        expected_cos, expected_sin = theta.cos(), theta.sin()
        if factor != 1.0:
            expected_cos, expected_sin = expected_cos * factor, expected_sin * factor
        if not (torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)):
            return False
    return True


def cos_sin(run, positions: torch.Tensor, freq: torch.Tensor, factor: float, low: int, high: int):
    """`(cos, sin)` `[*positions.shape, r/2]` float32 for contiguous int64 CPU positions and a contiguous float32
    ladder `[r/2]` (`positions.numel() * r/2 <= LIMIT`), made by the C side of `run = entry()`; None when a
    position is outside `[low, high]` (the caller names it) or under a torch.func transform."""
    half, n = freq.shape[0], positions.numel()
    out = torch.empty(2, *positions.shape, half)  # cos, sin
    fn, vcos, vsin, _, local = run
    try:
        address, at = out.data_ptr(), positions.data_ptr()
    except RuntimeError:  # tensors of a torch.func transform have no memory: the caller's torch ops run
        return None
    ret = fn(pack(at, freq.data_ptr(), address, address + 4 * n * half, vcos, vsin, local, n, half, MODE, low, high,
                  factor, factor != 1.0, torch.get_num_threads()))
    if ret == OUT_OF_RANGE:
        return None
    if ret != 0:
        raise RuntimeError(f"posenc angles refused {n} x {half} angles (code {ret}; a bug: the caller checks sizes)")
    return out[0], out[1]
