"""The Triton kernels on the CPU under the interpreter (TRITON_INTERPRET=1), for the kernel tests that run them
(tests/kernels/test_triton_rope.py, tests/kernels/experimental/test_triton_append.py); on a GPU, nothing changes."""

import importlib
import os

import torch


def use_interpreter_without_a_gpu() -> None:
    """Call before the kernels are imported: they read TRITON_INTERPRET when they are decorated."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreted(monkeypatch, append: bool = False) -> None:
    """The kernels decorated in interpreter mode, reloaded where another test (the doctests) imported them without
    it; `append`: the fused rope + KV append too, rebuilt on the rotation block of the module now loaded."""
    if torch.cuda.is_available():
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import posenc.kernels.triton_rope as rope_kernels

    if type(rope_kernels._rope_kernel).__name__ != "InterpretedFunction":
        importlib.reload(rope_kernels)
    if append:
        import posenc.kernels.experimental.triton_append as append_kernels

        if (type(append_kernels._append_kernel).__name__ != "InterpretedFunction"
                or append_kernels._rotate_block is not rope_kernels._rotate_block):
            importlib.reload(append_kernels)
