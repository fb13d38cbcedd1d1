"""The reference rotation under `torch.compile`: inductor's generated code, dynamic shapes (no recompile per t).

Compiled once per process on first use (seconds); kept for comparison and for devices without a
kernel. Measured on the 2-core CPU it is slower than the C kernel (docs/performance.md).
"""

from __future__ import annotations

import functools

import torch

from .apply import apply_rope

__all__ = ["apply_rope_compiled"]


_MAX_GRAPHS = 256  # 4 dtypes x 3 pairings x 4 layouts x grad on/off x rotary/full: fewer than this


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(apply_rope, dynamic=True, fullgraph=True)


def apply_rope_compiled(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **kwargs) -> torch.Tensor:
    """`apply_rope(x, cos, sin, **kwargs)` through `torch.compile(dynamic=True, fullgraph=True)`."""
    if torch.compiler.is_compiling():  # already inside a compiled region: trace the reference directly
        return apply_rope(x, cos, sin, **kwargs)
    # Each dtype, pairing, layout and grad mode is its own graph: past dynamo's default of 8 graphs per code
    # object, fullgraph=True would fail hard. The limit is raised for this call only (config.patch restores it).
    from torch import _dynamo

    with _dynamo.config.patch(recompile_limit=_MAX_GRAPHS):
        return _compiled()(x, cos, sin, **kwargs)
