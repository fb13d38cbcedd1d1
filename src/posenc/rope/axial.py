"""Axial RoPE for vision patches (Qwen2-VL / Qwen2.5-VL vision encoders): each patch rotates by its
row and its column.

With `a` position axes (2 for (h, w)), each axis gets `head_dim / (2a)` rotation pairs with the
frequencies of an ordinary RoPE of width `head_dim / a`; the per-pair angle table is the axes'
angles side by side, `[h-angles | w-angles]`, and the rotation is the usual split-half one over the
whole head, so `posenc.apply_rope` applies it (no separate kernel).

The patch order is the vision encoder's: for each image or video (T, H, W) in `grid_thw`, the
patches of each m x m merge window are contiguous (window by window, row-major; row-major inside a
window), and the H x W layout repeats for each of the T frames.

    >>> import torch, posenc
    >>> pos = vision_patch_positions(torch.tensor([[1, 2, 4]]), spatial_merge_size=2)
    >>> pos.T.tolist()
    [[0, 0, 1, 1, 0, 0, 1, 1], [0, 1, 0, 1, 2, 3, 2, 3]]
    >>> cos, sin = axial_cos_sin(pos, head_dim=16)                   # [8 patches, 8 pairs]
    >>> x = torch.randn(8, 3, 16)                                   # [patches, heads, head_dim]
    >>> posenc.apply_rope(x, cos, sin, layout="thd").shape
    torch.Size([8, 3, 16])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import choice, fail, integer, integer_tensor
from ..errors import positions as check_positions
from . import tables
from .apply import apply_rope
from .scaling import check_base, default_inv_freq

__all__ = ["vision_patch_positions", "axial_cos_sin", "AxialRope"]


def vision_patch_positions(grid_thw: Any, spatial_merge_size: int = 2) -> torch.Tensor:
    """Per-patch (row, column) positions of the vision encoder's input, in its merge-window order.

    Args:
        grid_thw: `[n, 3]` integer (T, H, W) patches per image or video (the processor's `image_grid_thw`).
        spatial_merge_size: m, the side of the merge window; H and W must be multiples of m.
    Returns:
        `[sum(T * H * W), 2]` int64 (row, column) positions.
    Raises:
        PosencError: a grid that is not `[n, 3]` positive integers, H or W not a multiple of m.
    """
    m = integer("spatial_merge_size", spatial_merge_size, min=1, what="an integer >= 1")
    if isinstance(grid_thw, torch.Tensor):
        grid_thw = integer_tensor("grid_thw", grid_thw, ndim=(2,), what="an integer tensor of shape [n, 3]").tolist()
    if not isinstance(grid_thw, (list, tuple)) or any(not isinstance(g, (list, tuple)) or len(g) != 3 for g in grid_thw):
        fail("grid_thw", "an integer tensor or list of shape [n, 3] (T, H, W per row)", grid_thw)
    parts = [torch.zeros(0, 2, dtype=torch.int64)]
    for k, (t, h, w) in enumerate(grid_thw):
        t, h, w = (integer(f"grid_thw[{k}]", v, min=1, what="positive integers (T, H, W)") for v in (t, h, w))
        if h % m or w % m:
            fail(f"grid_thw[{k}]", f"H and W multiples of spatial_merge_size={m}", [t, h, w])
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)  # [H/m, m, W/m, m]
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        window_major = (0, 2, 1, 3)  # [H/m, W/m, m, m]: window by window, then inside the window
        frame = torch.stack((rows.permute(window_major).flatten(), cols.permute(window_major).flatten()), dim=-1)
        parts.append(frame.repeat(t, 1))  # [T*H*W, 2]
    return torch.cat(parts)


def axial_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float = 10000.0, precision: str = "float32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair cos/sin tables of axial RoPE, `[axis 0 angles | axis 1 angles | ...]`.

    Args:
        positions: `[..., a]` integer positions, one column per axis (`[n, 2]` (row, column) for patches).
        head_dim: channels per head; a multiple of 2a. Each axis gets head_dim/(2a) pairs with the
            inverse frequencies of a RoPE of width head_dim/a (Qwen2-VL: `theta ** (-2i / (head_dim/2))`).
        base: theta (10000 in Qwen2-VL's vision encoder).
        precision: "float32" (as the checkpoints compute) or "exact" (see `posenc.rope.tables`).
    Returns:
        `(cos, sin)`, float32, `[..., head_dim/2]`, for `apply_rope(x, cos, sin)` over the whole head.
    Raises:
        PosencError: non-integer or negative positions, a head_dim that the axes do not divide.
    """
    if isinstance(positions, torch.Tensor) and positions.ndim == 0:
        fail("positions", "an integer tensor [..., a] with one column per axis", positions)
    positions = check_positions("positions", positions)
    axes = positions.shape[-1]
    what = f"a positive multiple of 2 * {axes} axes"
    if axes == 0 or integer("head_dim", head_dim, min=1, what=what) % (2 * axes):
        fail("head_dim", what, head_dim)
    inv_freq = default_inv_freq(base, head_dim // axes)  # [head_dim / (2a)]
    theta = tables.angles(positions, inv_freq, precision)  # [..., a, head_dim / (2a)]
    return tables.cos_sin_from_angles(theta.flatten(-2))  # [..., head_dim/2]


@dataclass(frozen=True)
class AxialRope:
    """One vision tower's axial RoPE: which axis fills which block of the table, and how channels pair.

    Args:
        head_dim: channels per head (all of them rotate); a multiple of 2 * len(axis_order).
        base: theta of each axis' ladder (that of a RoPE of width head_dim / axes).
        axis_order: the position column behind each block of the table, left to right: (0, 1) is
            `[row angles | column angles]` (Qwen2-VL and most towers), (1, 0) `[column | row]` (Step3 vision,
            Inkling 2).
        pairing: "split_half" (the table repeated over both halves of the head) or "interleaved"
            (each angle on channels 2i, 2i + 1).
    Raises:
        PosencError: a head_dim the axes do not divide, a bad base, an order that is not a permutation, or an
            unknown pairing.

        >>> rope = AxialRope(head_dim=8, axis_order=(1, 0))
        >>> cos, sin = rope.cos_sin(torch.tensor([[0, 3]]))        # one patch: row 0, column 3
        >>> [round(v, 4) for v in sin[0].tolist()]                  # [column angles | row angles]
        [0.1411, 0.03, 0.0, 0.0]
    """

    head_dim: int
    base: float = 10000.0
    axis_order: tuple[int, ...] = (0, 1)
    pairing: str = "split_half"

    def __post_init__(self) -> None:
        order = tuple(integer(f"axis_order[{i}]", a, min=0) for i, a in enumerate(self.axis_order))
        if sorted(order) != list(range(len(order))) or not order:
            fail("axis_order", "a permutation of the position columns, such as (0, 1) or (1, 0)", self.axis_order)
        what = f"a positive multiple of 2 * {len(order)} axes"
        if integer("head_dim", self.head_dim, min=1, what=what) % (2 * len(order)):
            fail("head_dim", what, self.head_dim)
        object.__setattr__(self, "axis_order", order)
        object.__setattr__(self, "base", check_base(self.base))
        choice("pairing", self.pairing, ("split_half", "interleaved"))

    def cos_sin(self, positions: torch.Tensor, precision: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair tables `[..., head_dim/2]` for positions `[..., axes]` (one column per axis, as the tower's
        `(row, column)` patch positions); see `axial_cos_sin`."""
        if not isinstance(positions, torch.Tensor) or positions.ndim == 0 or positions.shape[-1] != len(self.axis_order):
            fail("positions", f"an integer tensor [..., {len(self.axis_order)}] (one column per axis)", positions)
        order = torch.tensor(self.axis_order, device=positions.device)
        return axial_cos_sin(positions.index_select(-1, order), self.head_dim, self.base, precision)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, *, layout: str = "thd") -> torch.Tensor:
        """`x` (`[patches, h, head_dim]` for "thd", or "bhtd" / "bthd") rotated at `positions [patches, axes]`."""
        cos, sin = self.cos_sin(positions)  # [patches, head_dim/2]
        return apply_rope(x, cos, sin, pairing=self.pairing, layout=layout)
