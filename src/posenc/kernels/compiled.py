"""The reference rotation under `torch.compile`: inductor's generated code, dynamic shapes (no recompile per t).

Compiled once per process on first use (seconds); kept for comparison and for devices without a
kernel. Measured on the 2-core CPU it is slower than the C kernel (docs/performance.md).
"""

from __future__ import annotations

import functools

import torch

from ..rope.apply import apply_rope

__all__ = ["apply_rope_compiled"]


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(apply_rope, dynamic=True, fullgraph=True)


def apply_rope_compiled(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **kwargs) -> torch.Tensor:
    """`apply_rope(x, cos, sin, **kwargs)` through `torch.compile(dynamic=True, fullgraph=True)`."""
    if torch.compiler.is_compiling():  # already inside a compiled region: trace the reference directly
        return apply_rope(x, cos, sin, **kwargs)
    return _compiled()(x, cos, sin, **kwargs)
