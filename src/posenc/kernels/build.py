"""Build and load the C kernel library (`SOURCES` and `HEADERS`, beside this file); nothing here knows its ABI.

Two places, in order (`load`):

1. The library built when the package was installed (`setup.py`: `posenc/kernels/_rope_cpu<ext suffix>`), used
   only when the key compiled into it (`posenc_build_key()`) equals `build_key()` here: same source files,
   flags and CPU. `-march=native` makes it CPU-specific, so a wheel or a shared install built elsewhere is
   refused.
2. Else a first-use build with the system C compiler (`$CC`, else gcc, cc or clang) into a per-user cache
   (`$POSENC_CACHE_DIR`, else `$XDG_CACHE_HOME/posenc` or `~/.cache/posenc`), keyed by the same key and the
   compiler, so a fresh machine builds it once (seconds) and never again.

When neither works (or a source file is missing, so that no key can be computed), one warning names why and
the callers run the reference. This file imports only the standard library: `setup.py` loads it by path to
compute the key and name the sources at install time.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

__all__ = ["library", "loaded", "describe", "load", "build_key", "installed_library", "missing_files", "FLAGS",
           "COMPILE_FLAGS", "OPENMP_FLAGS", "FOLDER", "SOURCES", "HEADERS", "KERNEL_FILES"]

# no FMA: bit-exact vs the reference (gcc 12's SLP vectorizer makes fused complex products of interleaved
# scalar loops despite -ffp-contract=off, so it is off; the explicit SIMD rows are unaffected)
COMPILE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-tree-slp-vectorize", "-std=gnu11", "-pthread"]
OPENMP_FLAGS = ["-fopenmp"]  # parts on torch's OpenMP team (rope_pool.c); a build without it uses the pthread pool
FLAGS = [*COMPILE_FLAGS, "-fPIC", "-shared"]
FOLDER = Path(__file__).parent  # where the kernel's source files are (installed as package data)
SOURCES = ("rope_cpu.c", "rope_tile.c", "rope_pool.c", "rope_angles.c")  # compiled together into the one library
HEADERS = ("rope_tile.h", "rope_simd.h", "rope_heads.h", "rope_pool.h", "rope_angles.h")  # included by them (not on the command line)
KERNEL_FILES = SOURCES + HEADERS  # every file the library is built from: all of them are in its key
INSTALLED_NAME = "_rope_cpu"  # setup.py's Extension("posenc.kernels._rope_cpu"); no PyInit, loaded with ctypes


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
    try:  # -march=native output depends on the CPU: key the library on its flags
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def missing_files(folder: Path = FOLDER) -> list[str]:
    """The names in `KERNEL_FILES` that are not files in `folder` (a broken install when any)."""
    return [name for name in KERNEL_FILES if not (folder / name).is_file()]


def build_key(folder: Path = FOLDER) -> str:
    """What a library built here from the `KERNEL_FILES` in `folder` must report: a hash of every one of them
    (name and bytes), the flags and the CPU. Raises `OSError` when one cannot be read (`missing_files`)."""
    parts = [name.encode() + b"\0" + (folder / name).read_bytes() for name in KERNEL_FILES]
    parts += [" ".join(FLAGS).encode(), platform.machine().encode(), _cpu_signature().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def key_define(key: str) -> str:
    """The compiler flag that bakes `key` into the library (read back by `posenc_build_key()`)."""
    return f'-DPOSENC_BUILD_KEY="{key}"'


def installed_library(folder: Path = FOLDER) -> Path | None:
    """The library the package install built into `folder`, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / (INSTALLED_NAME + suffix)
        if path.is_file():
            return path
    return None


def _compile(cc: str, folder: Path, target: Path, key: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        errors = []
        # some compilers (or CPUs) reject -march=native; some compilers have no OpenMP
        for arch in (["-march=native", *OPENMP_FLAGS], [*OPENMP_FLAGS], ["-march=native"], []):
            cmd = [cc, *FLAGS, *arch, key_define(key), "-o", str(out), *(str(folder / name) for name in SOURCES)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(out, target)  # atomic: concurrent builders never see a half-written library
                return
            errors.append(proc.stderr.strip()[-400:])
        raise OSError(" / ".join(errors))


def _key_of(lib: ctypes.CDLL) -> str | None:
    try:
        fn = lib.posenc_build_key
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    raw = fn()
    return raw.decode() if raw else None


def load(installed: Path | None, folder: Path = FOLDER) -> tuple[ctypes.CDLL | None, str]:
    """The library and a line saying which one (`describe`), or None and why none; not cached.

    `installed` is the install-time build to try first (None: none); `folder` holds the `KERNEL_FILES` it must
    match (and a first-use build compiles). Warns once when nothing loads."""
    lost = missing_files(folder)
    if lost:  # no key to check an installed build against, nothing to compile
        return _unavailable(f"kernel source files missing from {folder}: {', '.join(lost)} (reinstall posenc)")
    key = build_key(folder)
    refused = ""
    if installed is not None:
        try:
            lib = ctypes.CDLL(str(installed))
        except OSError as exc:
            refused = f"installed build {installed} does not load ({exc}); "
        else:
            found = _key_of(lib)
            if found == key:
                return lib, f"cpu kernel: installed build {installed}"
            refused = f"installed build {installed} has key {found}, this machine and source need {key}; "
    why = _first_use(folder, key)
    if not isinstance(why, str):
        return why, f"cpu kernel: {refused}first-use build {why._name}"
    return _unavailable(refused + why)


def _unavailable(why: str) -> tuple[None, str]:
    warnings.warn(f"posenc: the C kernel is unavailable, the reference runs instead (much slower): {why}",
                  RuntimeWarning, stacklevel=1)
    return None, f"reference ({why})"


def _first_use(folder: Path, key: str) -> ctypes.CDLL | str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if not cc:
        return "no C compiler found (set $CC or install gcc)"
    name = hashlib.sha256(f"{key}\0{cc}".encode()).hexdigest()[:16]
    target = _target(f"rope_cpu-{name}.so")
    if isinstance(target, str):
        return target
    try:
        if not target.exists():
            _compile(cc, folder, target, key)
        return ctypes.CDLL(str(target))
    except OSError as exc:
        return f"building {', '.join(SOURCES)} with {cc} failed: {exc}"


@functools.lru_cache(maxsize=None)  # one dlopen per process: the loaded library is the process's anyway
def _loaded() -> tuple[ctypes.CDLL | None, str]:
    return load(installed_library())


def loaded() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (`library` says why)."""
    return _loaded()[0]


def library() -> ctypes.CDLL | str:
    """The loaded kernel library, or a string saying why there is none (warned once)."""
    lib, line = _loaded()
    return lib if lib is not None else line


def describe() -> str:
    """One line saying which rotation kernel runs on CPU: the installed build, a first-use build, or the
    reference and why."""
    return _loaded()[1]
