"""The constants the kernels and their callers share: pairing and dtype codes, the C kernel's row limits, the
exact-phase reduction. Plain data, no imports beyond the standard library and torch: `posenc.rope` reads them
from here, so the kernels never import `rope`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["PAIRING_CODES", "ANGLE_CODES", "DTYPE_CODES", "MAX_ROTARY_DIM", "MAX_HEAD_DIM", "TWO_PI_PARTS",
           "EXACT_LIMIT", "fits"]

# which channels pair, as the C and Triton kernels number them (posenc.rope.apply.PAIRINGS names them)
PAIRING_CODES = {"split_half": 0, "interleaved": 1, "interleaved_to_split_half": 2}
# where the Triton kernel's angles come from: table rows, or computed as the "float32" / "exact" precision
ANGLE_CODES = {"table": 0, "float32": 1, "exact": 2}
# the storage dtypes the C kernel takes (RopeArgs.dtype)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}

# rope_tile.h's row buffers: MAX_HALF pairs, 2 * MAX_HALF + 2048 channels (wider rows run on the reference)
MAX_ROTARY_DIM, MAX_HEAD_DIM = 2048, 4096

# 2*pi in three parts (Cody-Waite): the first has 24 significant bits, so k * TWO_PI_PARTS[0] is exact in
# float64 for |k| < 2**29; the second is float64(2*pi) minus the first (exact); the third 2*pi - float64(2*pi).
# posenc.rope.tables and the Triton kernels reduce exact phases with the same three parts.
TWO_PI_PARTS = (6.2831854820251465, 2 * math.pi - 6.2831854820251465, 2.4492935982947064e-16)
EXACT_LIMIT = 2**29  # |p| below this keeps p * float32 frequency exact in float64


def fits(rotary_dim: int, head_dim: int) -> bool:
    """Whether the C kernel's row buffers hold rows this wide (larger ones run on the reference)."""
    return rotary_dim <= MAX_ROTARY_DIM and head_dim <= MAX_HEAD_DIM
