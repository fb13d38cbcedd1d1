"""The only place RoPE angles are made: cos/sin for explicit positions, float32 or exact-phase.

Tables are returned per rotation pair, `[..., r/2]`, in float32, never cached in a module buffer
(so `model.to(torch.bfloat16)` cannot cast them).

Precision (angle errors against the exact phase `p * inv_freq` of the same float32 frequencies, measured
by tests/rope/test_tables_precision.py with mpmath at d = 128, theta = 1e4 and 5e5, 33 positions ending at each p):
- `"float32"` (default): `angle = float32(p) * inv_freq`, rounded once to float32, then `cos`/`sin` in
  float32: exactly what transformers (and so the checkpoints) compute. The error is half an ulp of the
  angle, `<= |angle| * 2**-24` rad, so it grows with the position: measured max 1.9e-3 rad at p = 2**16,
  3.1e-2 at 2**20 and 0.50 at 2**24 (channel 0, `inv_freq = 1`, is exact; channel 1 carries the worst
  error). Above 2**24 `float32(p)` itself is rounded (odd positions are lost).
- `"exact"`: the same float32 frequencies, phase computed without rounding: a float32 frequency has a
  24-bit significand, so `p * inv_freq` is exact in float64 for `|p| < 2**29`; it is reduced to
  [-pi, pi] with 2*pi in three parts (Cody-Waite) and cos/sin are taken in float64. For `inv_freq <= 1`
  (any base > 1 and scaling factors >= 1) the reduced angle is within 5e-16 rad of the true phase mod
  2*pi for `|p| <= 2**24` (measured 2.2e-16 at 2**16, 2**20 and 2**24) and within 4e-15 rad for
  `|p| < 2**29`; positions at or beyond 2**29 raise. What remains is the final rounding of cos/sin to
  float32, at most 2**-25 (3e-8).

    >>> import torch
    >>> from posenc.rope.tables import cos_sin
    >>> c, s = cos_sin(torch.tensor([0, 1]), torch.tensor([1.0, 0.5]))
    >>> c.shape, float(c[0, 0]), float(s[0, 0])
    (torch.Size([2, 2]), 1.0, 0.0)
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from ..errors import choice, fail, positions as check_positions

__all__ = ["TWO_PI_PARTS", "angles", "cos_sin", "cos_sin_from_angles", "check_precision", "PRECISIONS"]

Precision = Literal["float32", "exact"]
PRECISIONS = ("float32", "exact")

# 2*pi in three parts (Cody-Waite): the first has 24 significant bits, so k * TWO_PI_PARTS[0] is exact in
# float64 for |k| < 2**29; the second is float64(2*pi) minus the first (exact); the third 2*pi - float64(2*pi).
# Public: the Triton kernels reduce phases with the same three parts.
TWO_PI_PARTS = (6.2831854820251465, 2 * math.pi - 6.2831854820251465, 2.4492935982947064e-16)
_TWO_PI_HI, _TWO_PI_MID, _TWO_PI_LO = TWO_PI_PARTS
_EXACT_LIMIT = 2**29  # |p| below this keeps p * float32 frequency exact in float64


def check_precision(precision: object) -> str:
    """The one check of a `precision=` argument: "float32" or "exact"."""
    return choice("precision", precision, PRECISIONS)


def angles(positions: torch.Tensor, inv_freq: torch.Tensor, precision: Precision = "float32") -> torch.Tensor:
    """Rotation angles `p * inv_freq`.

    Args:
        positions: integer positions of any shape `[...]`.
        inv_freq: `[r/2]` float32 inverse frequencies.
        precision: `"float32"` (checkpoint-exact) or `"exact"` (float64, reduced to [-pi, pi]).
    Returns:
        `[..., r/2]` float32 angles, or float64 reduced phases for `"exact"`.
    Raises:
        PosencError: an unknown precision, or `|position| >= 2**29` with `"exact"`.

    Example (the exact phase of position 7 at frequency 1 is 7 - 2*pi):
        >>> import math, torch
        >>> theta = angles(torch.tensor([7]), torch.tensor([1.0]), "exact")
        >>> theta.dtype, abs(float(theta[0, 0]) - (7 - 2 * math.pi)) < 1e-15
        (torch.float64, True)
    """
    check_precision(precision)
    positions = check_positions("position_ids", positions, allow_negative=True)  # no host sync; uint -> int64
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
    if precision == "float32":
        # fp32: bf16 positions lose integer precision above 256; the product is rounded once, as in transformers
        return positions.float()[..., None] * inv_freq  # [..., r/2]
    if positions.numel() and int(positions.abs().max()) >= _EXACT_LIMIT:
        fail("position_ids", "|position| < 2**29 for precision='exact'", int(positions.abs().max()))
    phase = positions.double()[..., None] * inv_freq.double()  # exact: 24-bit x 29-bit significands
    turns = torch.round(phase / (2 * math.pi))
    return ((phase - turns * _TWO_PI_HI) - turns * _TWO_PI_MID) - turns * _TWO_PI_LO  # [..., r/2], in [-pi, pi] up to 1 ulp


def cos_sin_from_angles(theta: torch.Tensor, attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `theta`, times `attention_factor`, as float32 (computed in theta's precision).

    Args:
        theta: `[..., r/2]` angles (float32, or float64 from `precision="exact"`).
        attention_factor: multiplier applied to both cos and sin, as transformers applies it.
    Returns:
        `(cos, sin)`, each `[..., r/2]` float32.
    """
    cos, sin = theta.cos(), theta.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.float(), sin.float()


def cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    precision: Precision = "float32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[..., r/2]` (float32) for `positions [...]`, with the attention factor applied.

    Args:
        positions: integer positions `[...]`.
        inv_freq: `[r/2]` float32 inverse frequencies.
        attention_factor: multiplier on cos and sin.
        precision: `"float32"` or `"exact"` (see the module docstring).
    Returns:
        `(cos, sin)`, each `[..., r/2]` float32.
    """
    return cos_sin_from_angles(angles(positions, inv_freq, precision), attention_factor)
