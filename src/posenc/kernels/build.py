"""Build and load the C kernel library (`rope_cpu.c`, beside this file); nothing here knows its ABI.

Two places, in order (`load`):

1. The library built when the package was installed (`setup.py`: `posenc/kernels/_rope_cpu<ext suffix>`), used
   only when the key compiled into it (`posenc_build_key()`) equals `build_key()` here: same source, flags and
   CPU. `-march=native` makes it CPU-specific, so a wheel or a shared install built elsewhere is refused.
2. Else a first-use build with the system C compiler (`$CC`, else gcc, cc or clang) into a per-user cache
   (`$POSENC_CACHE_DIR`, else `$XDG_CACHE_HOME/posenc` or `~/.cache/posenc`), keyed by the same key and the
   compiler, so a fresh machine builds it once (well under a second) and never again.

When neither works, one warning names why and the callers run the reference. This file imports only the
standard library: `setup.py` loads it by path to compute the key at install time.
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

__all__ = ["library", "describe", "load", "build_key", "installed_library", "FLAGS", "COMPILE_FLAGS", "SOURCE"]

COMPILE_FLAGS = ["-O3", "-ffp-contract=off", "-std=gnu11", "-pthread"]  # no FMA: bit-exact vs the reference
FLAGS = [*COMPILE_FLAGS, "-fPIC", "-shared"]
SOURCE = Path(__file__).with_name("rope_cpu.c")
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


def build_key(source: Path = SOURCE) -> str:
    """What a library built here from `source` must report: a hash of the source, flags and CPU."""
    parts = [source.read_bytes(), " ".join(FLAGS).encode(), platform.machine().encode(), _cpu_signature().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def key_define(key: str) -> str:
    """The compiler flag that bakes `key` into the library (read back by `posenc_build_key()`)."""
    return f'-DPOSENC_BUILD_KEY="{key}"'


def installed_library(folder: Path = SOURCE.parent) -> Path | None:
    """The library the package install built into `folder`, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / (INSTALLED_NAME + suffix)
        if path.is_file():
            return path
    return None


def _compile(cc: str, source: Path, target: Path, key: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        errors = []
        for arch in (["-march=native"], []):  # some compilers (or CPUs) reject -march=native
            cmd = [cc, *FLAGS, *arch, key_define(key), "-o", str(out), str(source)]
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


def load(installed: Path | None, source: Path = SOURCE) -> tuple[ctypes.CDLL | None, str]:
    """The library and a line saying which one (`describe`), or None and why none; not cached.

    `installed` is the install-time build to try first (None: none). Warns once when nothing loads."""
    key = build_key(source)
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
    why = _first_use(source, key)
    if not isinstance(why, str):
        return why, f"cpu kernel: {refused}first-use build {why._name}"
    why = refused + why
    warnings.warn(f"posenc: the C kernel is unavailable, the reference runs instead (much slower): {why}",
                  RuntimeWarning, stacklevel=1)
    return None, f"reference ({why})"


def _first_use(source: Path, key: str) -> ctypes.CDLL | str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if not cc:
        return "no C compiler found (set $CC or install gcc)"
    name = hashlib.sha256(f"{key}\0{cc}".encode()).hexdigest()[:16]
    target = _target(f"rope_cpu-{name}.so")
    if isinstance(target, str):
        return target
    try:
        if not target.exists():
            _compile(cc, source, target, key)
        return ctypes.CDLL(str(target))
    except OSError as exc:
        return f"building {source.name} with {cc} failed: {exc}"


@functools.lru_cache(maxsize=None)  # one dlopen per process: the loaded library is the process's anyway
def _loaded() -> tuple[ctypes.CDLL | None, str]:
    return load(installed_library())


def library() -> ctypes.CDLL | str:
    """The loaded kernel library, or a string saying why there is none (warned once)."""
    lib, line = _loaded()
    return lib if lib is not None else line


def describe() -> str:
    """One line saying which rotation kernel runs on CPU: the installed build, a first-use build, or the
    reference and why."""
    return _loaded()[1]
