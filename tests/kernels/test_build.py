"""kernels.build: the install-time library is used only when its baked-in key matches, else the first-use build,
else one warning naming why. Every library here is built into a tmp dir; the real installed one is never touched."""

import ctypes
import fnmatch
import re
import shutil
import subprocess
import tomllib
import warnings
from pathlib import Path

import pytest

from posenc.kernels import build

CC = shutil.which("gcc") or shutil.which("cc")
needs_cc = pytest.mark.skipif(CC is None, reason="needs a C compiler")


def _compile(path, key):
    """A library as setup.py builds it, with `key` baked in (our own gcc call, not build._compile)."""
    sources = [str(build.FOLDER / name) for name in build.SOURCES]
    subprocess.run([CC, *build.FLAGS, build.key_define(key), "-o", str(path), *sources], check=True)
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
        pytest.skip(f"{installed} is stale (a kernel source file or the CPU changed since the install): reinstall")
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


def _copy_sources(folder, skip=()):
    folder.mkdir()
    for name in build.KERNEL_FILES:
        if name not in skip:
            (folder / name).write_bytes((build.FOLDER / name).read_bytes())
    return folder


def test_kernel_files_are_every_c_and_h_file_and_every_include():
    # the key (and the wheel, and both builds) cover exactly the C files beside build.py and what they include
    on_disk = {p.name for p in build.FOLDER.iterdir() if p.suffix in (".c", ".h")}
    assert set(build.KERNEL_FILES) == on_disk and len(build.KERNEL_FILES) == len(on_disk)
    assert all(n.endswith(".c") for n in build.SOURCES) and all(n.endswith(".h") for n in build.HEADERS)
    included = {inc for name in build.KERNEL_FILES
                for inc in re.findall(r'^#include "([^"]+)"', (build.FOLDER / name).read_text(), re.M)}
    assert included == set(build.HEADERS)  # every header is included somewhere, and only these are


def test_package_data_ships_every_kernel_file():
    # a wheel or sdist without a header could neither check an installed build's key nor build on first use
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["posenc"]
    for name in build.KERNEL_FILES:
        assert any(fnmatch.fnmatch(f"kernels/{name}", g) for g in globs), name


def test_key_follows_every_kernel_file_and_cpu(tmp_path, monkeypatch):
    copy = _copy_sources(tmp_path / "src")
    assert build.build_key(copy) == build.build_key()
    for name in build.KERNEL_FILES:  # one byte more in any source or header: another key
        original = (copy / name).read_bytes()
        (copy / name).write_bytes(original + b"\n")
        assert build.build_key(copy) != build.build_key(), name
        (copy / name).write_bytes(original)
    assert build.build_key(copy) == build.build_key()
    here = build.build_key()
    monkeypatch.setattr(build, "_cpu_signature", lambda: "flags\t: fpu sse2")  # another CPU
    assert build.build_key() != here


@pytest.mark.parametrize("lost", ["rope_pool.c", "rope_simd.h"])
def test_a_missing_kernel_file_runs_the_reference_naming_it(tmp_path, monkeypatch, lost):
    monkeypatch.setenv("POSENC_CACHE_DIR", str(tmp_path / "cache"))
    copy = _copy_sources(tmp_path / "src", skip=(lost,))
    installed = build.installed_library()  # the real one, when there is: refused too (no key to check it by)
    with pytest.warns(RuntimeWarning, match="the C kernel is unavailable") as caught:
        lib, line = build.load(installed, copy)
    assert len(caught) == 1 and lib is None
    assert line == f"reference (kernel source files missing from {copy}: {lost} (reinstall posenc))"
    assert not (tmp_path / "cache").exists()  # nothing was built


@needs_cc
def test_an_edited_header_rebuilds(tmp_path, monkeypatch):
    # first-use build from a copy; an edited header (here: one that cannot compile) must not reuse that build
    monkeypatch.setenv("POSENC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", CC)
    copy = _copy_sources(tmp_path / "src")
    lib, line = build.load(None, copy)
    built = list((tmp_path / "cache" / "kernels").glob("rope_cpu-*.so"))
    assert lib is not None and len(built) == 1 and line == f"cpu kernel: first-use build {built[0]}"
    header = copy / "rope_simd.h"
    original = header.read_bytes()
    header.write_bytes(original + b'#error "edited after the build"\n')
    with pytest.warns(RuntimeWarning, match="the C kernel is unavailable"):
        lib, line = build.load(None, copy)
    assert lib is None and line.startswith("reference (building rope_cpu.c, rope_tile.c, rope_pool.c, rope_angles.c with ")
    assert "edited after the build" in line  # the compiler did read the edited header
    header.write_bytes(original)  # back as it was: the first build is found again, nothing rebuilt
    lib, line = build.load(None, copy)
    assert line == f"cpu kernel: first-use build {built[0]}"
    assert list((tmp_path / "cache" / "kernels").glob("rope_cpu-*.so")) == built
