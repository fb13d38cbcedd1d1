"""Build and load the C kernel library (`rope_cpu.c`, beside this file); nothing here knows its ABI.

The library is compiled with the system C compiler (`$CC`, else gcc, cc or clang) into a per-user cache
(`$POSENC_CACHE_DIR`, else `$XDG_CACHE_HOME/posenc` or `~/.cache/posenc`), keyed by the source, the
flags and the CPU, so a fresh machine builds it once (well under a second) and never again.
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

__all__ = ["library", "FLAGS", "SOURCE"]

FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11", "-pthread"]  # no FMA: bit-exact vs the reference
SOURCE = Path(__file__).with_name("rope_cpu.c")


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
            proc = subprocess.run([cc, *FLAGS, *arch, "-o", str(out), str(source)], capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(out, target)  # atomic: concurrent builders never see a half-written library
                return
            errors.append(proc.stderr.strip()[-400:])
        raise OSError(" / ".join(errors))



@functools.lru_cache(maxsize=None)  # one dlopen per process: the loaded library is the process's anyway
def library() -> ctypes.CDLL | str:
    """The loaded kernel library, or a string saying why it cannot be built."""
    source = SOURCE
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if not cc:
        return "no C compiler found (set $CC or install gcc)"
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(FLAGS).encode(), cc.encode(),
                                     platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:16]
    target = _target(f"rope_cpu-{key}.so")
    if isinstance(target, str):
        return target
    try:
        if not target.exists():
            _compile(cc, source, target)
        return ctypes.CDLL(str(target))
    except OSError as exc:
        return f"building {source.name} with {cc} failed: {exc}"
