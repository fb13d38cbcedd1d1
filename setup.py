"""Builds the C rotation kernel at install time (metadata lives in pyproject.toml).

A plain C shared library, no Python module: `posenc.kernels.build` loads it with ctypes, only when the key baked
into it matches the machine. `optional=True`: without a compiler the install still succeeds and the kernel is
built on first use instead (or the reference runs).
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location("_posenc_build", Path(__file__).parent / "src/posenc/kernels/build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)  # standard library only: no torch at build time

FOLDER = "src/posenc/kernels"  # relative paths: setuptools wants them so
key = build.build_key(Path(__file__).parent / FOLDER)  # every source and header, as build.load checks it

setup(ext_modules=[Extension(
    "posenc.kernels." + build.INSTALLED_NAME, [f"{FOLDER}/{name}" for name in build.SOURCES],
    depends=[f"{FOLDER}/{name}" for name in build.HEADERS],  # an edited header rebuilds
    extra_compile_args=[*build.COMPILE_FLAGS, *build.OPENMP_FLAGS, "-march=native", build.key_define(key)],
    extra_link_args=["-pthread", *build.OPENMP_FLAGS], optional=True)])
