"""p-RoPE ("proportional" in transformers 5.x; Gemma 4's full-attention layers): the frequency ladder of the
whole head, with only its lowest-wavelength part kept.

Plain RoPE with a partial rotary factor p builds the ladder `base**(-2i / r)` over the rotated width
`r = p * head_dim` and leaves the other channels alone. p-RoPE instead keeps the ladder of the full head,
`base**(-2i / head_dim)` for the first `int(p * head_dim // 2)` pairs, and gives the remaining pairs frequency
0 (cos 1, sin 0: they pass through, but they are still "rotated", so the table has `head_dim / 2` pairs). Every
frequency is then divided by `factor` (position interpolation). The attention factor is 1.

    >>> import torch
    >>> inv, af = Proportional(fraction=0.25).inv_freq(1e6, 16)
    >>> inv.shape, int((inv == 0).sum()), af
    (torch.Size([8]), 6, 1.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import real
from .scaling.uniform import _check_dim, _set
from .scaling import check_base

__all__ = ["Proportional"]


@dataclass(frozen=True)
class Proportional:
    """p-RoPE: the full head's frequencies for the first `int(fraction * dim // 2)` pairs, 0 for the rest.

    Args:
        fraction: the share of pairs that rotate (transformers' `partial_rotary_factor`, default 1.0).
        factor: every frequency divided by it (default 1.0).
    Raises:
        PosencError: a fraction outside [0, 1] or a factor that is not a finite number > 0.
    """

    fraction: float = 1.0
    factor: float = 1.0
    name: ClassVar[str] = "proportional"
    depends_on_length: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _set(self, "fraction", real("partial_rotary_factor", self.fraction, ge=0.0, le=1.0))
        _set(self, "factor", real("factor", self.factor, gt=0.0))

    def rotating_pairs(self, dim: int) -> int:
        """How many of the `dim / 2` pairs have a non-zero frequency (transformers' `rope_angles`)."""
        return int(self.fraction * dim // 2)  # float floor division, then int: transformers' expression

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`([dim/2] float32 inverse frequencies, attention factor 1.0)`; `seq_len` is ignored."""
        base, dim = check_base(base), _check_dim(dim)
        angles = self.rotating_pairs(dim)
        exponent = torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(dtype=torch.float32) / dim  # [angles]
        rotated = 1.0 / (base**exponent)
        inv = torch.cat((rotated, torch.zeros(dim // 2 - angles, dtype=torch.float32)))  # [dim/2]
        return inv / self.factor, 1.0
