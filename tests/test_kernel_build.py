"""kernels.build: the install-time library is used only when its baked-in key matches, else the first-use build,
else one warning naming why. Every library here is built into a tmp dir; the real installed one is never touched."""

import ctypes
import shutil
import subprocess
import warnings

import pytest

from posenc.kernels import build

CC = shutil.which("gcc") or shutil.which("cc")
needs_cc = pytest.mark.skipif(CC is None, reason="needs a C compiler")


def _compile(path, key):
    """A library as setup.py builds it, with `key` baked in (our own gcc call, not build._compile)."""
    subprocess.run([CC, *build.FLAGS, build.key_define(key), "-o", str(path), str(build.SOURCE)], check=True)
    return path


@needs_cc
def test_installed_build_with_matching_key_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("POSENC_CACHE_DIR", str(tmp_path / "cache"))
    lib_path = _compile(tmp_path / ("_rope_cpu" + build.importlib.machinery.EXTENSION_SUFFIXES[0]), build.build_key())
    assert build.installed_library(tmp_path) == lib_path
    lib, line = build.load(lib_path)
    assert line == f"cpu kernel: installed build {lib_path}"
    assert build._key_of(lib) == build.build_key()
    assert not (tmp_path / "cache").exists()  # nothing was built on first use


def test_real_install_is_described():
    installed = build.installed_library()
    if installed is None:
        pytest.skip("package installed without the install-time build")
    if build._key_of(ctypes.CDLL(str(installed))) != build.build_key():
        pytest.skip(f"{installed} is stale (rope_cpu.c or the CPU changed since the install): reinstall")
    assert build.describe() == f"cpu kernel: installed build {installed}"


@needs_cc
@pytest.mark.parametrize("bad", ["wrong key", "not a library"])
def test_foreign_installed_build_is_refused_and_first_use_builds(tmp_path, monkeypatch, bad):
    monkeypatch.setenv("POSENC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", CC)
    installed = tmp_path / "_rope_cpu.so"
    if bad == "wrong key":
        _compile(installed, "0123456789abcdef")  # as if built on another CPU or from another source
    else:
        installed.write_bytes(b"\x7fELF truncated")
    lib, line = build.load(installed)
    assert f"installed build {installed}" in line
    assert ("has key 0123456789abcdef" if bad == "wrong key" else "does not load") in line
    built = list((tmp_path / "cache" / "kernels").glob("rope_cpu-*.so"))
    assert len(built) == 1 and line.endswith(f"first-use build {built[0]}")
    assert build._key_of(lib) == build.build_key()


def test_no_compiler_and_no_install_warns_once_naming_why(tmp_path, monkeypatch):
    monkeypatch.setenv("POSENC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, cc or clang on it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        results = [build.load(None) for _ in range(3)]
    assert [str(w.message) for w in caught] == [
        "posenc: the C kernel is unavailable, the reference runs instead (much slower): "
        "no C compiler found (set $CC or install gcc)"]
    assert caught[0].category is RuntimeWarning
    assert all(r == (None, "reference (no C compiler found (set $CC or install gcc))") for r in results)


def test_key_follows_source_and_cpu(tmp_path, monkeypatch):
    copy = tmp_path / "rope_cpu.c"
    copy.write_bytes(build.SOURCE.read_bytes())
    assert build.build_key(copy) == build.build_key()
    copy.write_bytes(build.SOURCE.read_bytes() + b"\n")
    assert build.build_key(copy) != build.build_key()
    here = build.build_key()
    monkeypatch.setattr(build, "_cpu_signature", lambda: "flags\t: fpu sse2")  # another CPU
    assert build.build_key() != here
