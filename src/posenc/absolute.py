"""Absolute position embeddings: sinusoidal tables in the three layouts checkpoints use, and learned tables.

Sinusoidal layouts (`layout=`), for width `dim` and frequencies `w_i`:
- `"interleaved"` (Vaswani et al.; DistilBERT, XLM): channel 2i = sin(p w_i), channel 2i+1 = cos(p w_i),
  `w_i = base**(-2i / dim)`; computed in float64 and rounded once (as their numpy code).
- `"half"` (Marian): the same frequencies, sin in the first ceil(dim/2) channels, cos in the rest.
- `"fairseq"` (M2M100, NLLB, fairseq): `w_i = exp(-i ln(base) / (half - 1))` with `half = dim // 2` (note
  the `half - 1`), `[sin | cos]` (+ a zero channel for odd dim), computed in float32, and logical position
  p read from row `p + padding_idx + 1` (fairseq numbers positions after the padding index).

Relative-offset property: for every frequency the (sin, cos) pair of position p + k is the pair of p
rotated by the angle k w_i, so `PE(p + k) = M_k PE(p)` with `M_k` block-rotation depending only on k.

    >>> import torch
    >>> sinusoidal_table(torch.tensor([0, 1]), 4).tolist()[0]
    [0.0, 1.0, 0.0, 1.0]
    >>> LearnedPositions(8, 4)(torch.tensor([[0, 7]])).shape
    torch.Size([1, 2, 4])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import Raw, choice, fail, integer, positions as check_positions
from .rope.scaling import check_base

__all__ = ["sinusoidal_table", "Sinusoidal", "LearnedPositions", "SINUSOIDAL_LAYOUTS"]

SINUSOIDAL_LAYOUTS = ("interleaved", "half", "fairseq")


def _check_table(dim: Any, base: Any, layout: Any) -> tuple[int, float]:
    """The one check of a sinusoidal table's width, base and layout."""
    choice("layout", layout, SINUSOIDAL_LAYOUTS)
    smallest = 4 if layout == "fairseq" else 1  # fairseq divides by half_dim - 1
    return integer("dim", dim, min=smallest, what=f"an integer >= {smallest} for layout {layout!r}"), check_base(base)


def sinusoidal_table(
    positions: torch.Tensor,
    dim: int,
    base: float = 10000.0,
    *,
    layout: str = "interleaved",
    padding_idx: int = 1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Sinusoidal embeddings of explicit logical positions.

    Args:
        positions: integer logical positions `[...]`, >= 0.
        dim: embedding width (odd widths allowed; "fairseq" needs >= 4).
        base: the frequency base (10000 in every checkpoint).
        layout: "interleaved", "half" or "fairseq" (see the module docstring).
        padding_idx: fairseq only: position p reads row p + padding_idx + 1 (M2M100: pad_token_id = 1).
        dtype: float32 (as checkpoints) or float64 (for analysis).
    Returns:
        `[..., dim]` table rows in `dtype`.
    Raises:
        PosencError: non-integer or negative positions, a bad width, base, layout or padding index.
    """
    positions = check_positions("positions", positions)
    dim, base = _check_table(dim, base, layout)
    if dtype not in (torch.float32, torch.float64):
        fail("dtype", "torch.float32 or torch.float64", dtype)
    if layout == "fairseq":
        padding_idx = integer("padding_idx", padding_idx, min=0)
        half = dim // 2
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        step = math.log(base) / (half - 1)
        inv_freq = torch.exp(torch.arange(half, device=positions.device).to(compute) * -step)  # [half]
        angle = (positions.long() + padding_idx + 1).to(compute)[..., None] * inv_freq  # [..., half]
        parts = [angle.sin(), angle.cos()]
        if dim % 2:
            parts.append(torch.zeros_like(angle[..., :1]))  # fairseq pads odd widths with a zero channel
        return torch.cat(parts, dim=-1).to(dtype)  # [..., dim]
    # interleaved / half: p / base**(2i/dim) in float64, as the numpy reference code
    sin_count, cos_count = (dim + 1) // 2, dim // 2
    denominators = torch.tensor([base ** (2 * i / dim) for i in range(sin_count)], dtype=torch.float64)
    angle = positions.double()[..., None] / denominators.to(positions.device)  # [..., ceil(dim/2)]
    sin, cos = angle.sin(), angle[..., :cos_count].cos()
    if layout == "half":
        return torch.cat((sin, cos), dim=-1).to(dtype)  # [..., dim]
    out = torch.empty(*angle.shape[:-1], dim, dtype=torch.float64, device=positions.device)
    out[..., 0::2], out[..., 1::2] = sin, cos
    return out.to(dtype)  # [..., dim]


@dataclass(frozen=True)
class Sinusoidal:
    """A sinusoidal table as an encoding value for `posenc.attention` (no parameters, no cached buffer).

    Args:
        dim, base, layout, padding_idx: see `sinusoidal_table`.
    Raises:
        PosencError: a bad width, base or layout.

        >>> import torch
        >>> Sinusoidal(6, layout="half").embedding(torch.arange(3)).shape
        torch.Size([3, 6])
    """

    dim: int
    base: float = 10000.0
    layout: str = "interleaved"
    padding_idx: int = 1

    def __post_init__(self) -> None:
        dim, base = _check_table(self.dim, self.base, self.layout)
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "padding_idx", integer("padding_idx", self.padding_idx, min=0))

    def embedding(self, positions: torch.Tensor) -> torch.Tensor:
        """`[..., dim]` float32 rows for integer positions `[...]`."""
        return sinusoidal_table(positions, self.dim, self.base, layout=self.layout, padding_idx=self.padding_idx)


class LearnedPositions(nn.Module):
    """A learned absolute table: position p reads row `p + offset` (OPT: offset 2), never past the end.

    Args:
        num_positions: rows in the table (including the `offset` leading rows).
        dim: embedding width.
        offset: leading rows that positions skip (kept unchanged by `resize`, like a ViT's CLS row).
    Raises:
        PosencError: non-positive sizes, an offset that leaves no rows.
    """

    def __init__(self, num_positions: int, dim: int, *, offset: int = 0):
        super().__init__()
        num_positions, dim = integer("num_positions", num_positions, min=1), integer("dim", dim, min=1)
        self.offset = integer("offset", offset, min=0, max=num_positions - 1,
                              what=f"an integer in [0, num_positions={num_positions})")
        self.weight = nn.Parameter(torch.randn(num_positions, dim) * 0.02)  # [num_positions, dim]

    @property
    def max_positions(self) -> int:
        """Logical positions 0 .. max_positions - 1 have a row."""
        return self.weight.shape[0] - self.offset

    def embedding(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows for integer logical positions `[...]` -> `[..., dim]` (PosencError past the table)."""
        positions = check_positions("positions", positions, device=self.weight.device)
        if positions.numel() and int(positions.max()) >= self.max_positions:
            fail("positions", f"positions < {self.max_positions} (the learned table's size; `resize` interpolates it)",
                 Raw(f"max {int(positions.max())}"))
        return self.weight[positions.long() + self.offset]  # [..., dim]

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Same as `embedding`."""
        return self.embedding(positions)

    def resize(self, max_positions: int, *, mode: str = "linear") -> "LearnedPositions":
        """A new table for `max_positions` logical positions, interpolating this one (1-D, align_corners=False).

        Args:
            max_positions: logical positions of the new table (the `offset` rows are copied unchanged).
            mode: "linear" or "nearest".
        Returns:
            A new `LearnedPositions`; this one is not modified.
        Raises:
            PosencError: a non-positive size or an unknown mode.
        """
        max_positions = integer("max_positions", max_positions, min=1)
        choice("mode", mode, ("linear", "nearest"))
        rows = self.weight.detach()[self.offset :].float().T[None]  # [1, dim, old]
        new = nn.functional.interpolate(rows, size=max_positions, mode=mode, **_corners(mode))[0].T  # [new, dim]
        return self._with_rows(new)

    def resize_grid(self, grid: tuple[int, int], new_grid: tuple[int, int], *, mode: str = "bicubic") -> "LearnedPositions":
        """Interpolate a table laid out as a `grid = (height, width)` patch grid (row-major), as ViTs do.

        Args:
            grid: the current `(height, width)`, with `height * width == max_positions`.
            new_grid: the target `(height, width)`.
            mode: "bicubic", "bilinear" or "nearest".
        Returns:
            A new `LearnedPositions` with `new_height * new_width` positions (offset rows copied).
        Raises:
            PosencError: a grid that does not match the table, non-positive sizes, an unknown mode.
        """
        grid, new_grid = (_grid(name, g) for name, g in (("grid", grid), ("new_grid", new_grid)))
        if grid[0] * grid[1] != self.max_positions:
            fail("grid", f"height * width = {self.max_positions} (the table's positions)", grid)
        choice("mode", mode, ("bicubic", "bilinear", "nearest"))
        rows = self.weight.detach()[self.offset :].float()  # [h*w, dim]
        image = rows.reshape(grid[0], grid[1], -1).permute(2, 0, 1)[None]  # [1, dim, h, w]
        image = nn.functional.interpolate(image, size=tuple(new_grid), mode=mode, **_corners(mode))
        return self._with_rows(image[0].permute(1, 2, 0).reshape(-1, rows.shape[-1]))  # [h'*w', dim]

    def _with_rows(self, rows: torch.Tensor) -> "LearnedPositions":
        table = torch.cat((self.weight.detach()[: self.offset].float(), rows), dim=0)  # [offset + new, dim]
        out = LearnedPositions(table.shape[0], table.shape[1], offset=self.offset)
        out.weight.data.copy_(table.to(self.weight.dtype))
        return out.to(self.weight.device)


def _corners(mode: str) -> dict:
    return {} if mode == "nearest" else {"align_corners": False}


def _grid(arg: str, grid: Any) -> tuple[int, int]:
    what = "(height, width) positive integers"
    if isinstance(grid, (str, bytes, torch.Tensor)) or not hasattr(grid, "__len__") or len(grid) != 2:
        fail(arg, what, grid)
    return integer(arg, grid[0], min=1, what=what), integer(arg, grid[1], min=1, what=what)
