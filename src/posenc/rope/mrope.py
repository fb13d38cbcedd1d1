"""Multi-axis RoPE (Qwen2-VL family): which position axis drives each frequency.

A multimodal token has three positions (temporal, height, width): `position_ids [3, b, t]`
(built by `posenc.rope.mrope_positions`).

Frequencies (the r/2 rotation pairs), each driven by one axis:
- sectioned (Qwen2-VL, Qwen2.5-VL): `mrope_section = (s_t, s_h, s_w)` contiguous blocks of frequencies,
  block k driven by axis k % 3;
- interleaved (Qwen3-VL): frequency j is driven by H if j % 3 == 1 and j < 3 s_h, by W if j % 3 == 2 and
  j < 3 s_w, else by T.
The angles are gathered per frequency and then go through the one rotation in `apply.py`.
For text, all three rows are equal and the result is exactly 1-D RoPE.

    >>> mrope_axis_map((1, 1, 2)).tolist()
    [0, 1, 2, 2]
    >>> mrope_axis_map((2, 1, 1), interleaved=True).tolist()
    [0, 1, 2, 0]
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import check_float_tensor, fail, integer, positions
from . import tables

__all__ = ["mrope_axis_map", "gather_axes", "mrope_cos_sin", "check_sections"]


def check_sections(sections: object) -> tuple[int, ...]:
    """The one check of an `mrope_section`: a non-empty list of integers >= 0, returned as a tuple."""
    if isinstance(sections, (str, bytes, torch.Tensor)) or not hasattr(sections, "__len__") or not len(sections):
        fail("mrope_section", "a non-empty list of non-negative integers", sections)
    return tuple(integer(f"mrope_section[{i}]", s, min=0) for i, s in enumerate(sections))


def mrope_axis_map(sections: tuple[int, ...], interleaved: bool = False) -> torch.Tensor:
    """`[sum(sections)]` int64: the position axis driving each frequency.

    Args:
        sections: frequencies per axis, summing to r/2.
        interleaved: Qwen3-VL's interleaved assignment instead of contiguous sections.
    """
    sections = check_sections(sections)
    total = sum(sections)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(sections)) % 3, torch.tensor(sections))
    if len(sections) != 3:
        fail("mrope_section", "3 sections (t, h, w) for interleaved M-RoPE", sections)
    axis = torch.zeros(total, dtype=torch.int64)
    for row in (1, 2):
        for j in range(row, min(3 * sections[row], total), 3):
            axis[j] = row
    return axis


def gather_axes(theta: torch.Tensor, axis_map: torch.Tensor) -> torch.Tensor:
    """Pick, for each frequency, the angle of the axis that drives it.

    Args:
        theta: `[a, ..., r/2]` angles for each of the a position axes.
        axis_map: `[r/2]` axis index per frequency (from `mrope_axis_map`).
    Returns:
        `[..., r/2]` angles.
    """
    index = axis_map.to(theta.device).expand(theta.shape[1:]).unsqueeze(0)  # [1, ..., r/2]
    return torch.gather(theta, 0, index).squeeze(0)


def mrope_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    sections: Sequence[int],
    *,
    interleaved: bool = False,
    attention_factor: float = 1.0,
    precision: str = "float32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair cos/sin tables for multi-axis positions, to rotate with `posenc.apply_rope`.

    Args:
        position_ids: `[3, b, t]` or `[3, t]` integer (temporal, height, width) positions.
        inv_freq: `[r/2]` float32 inverse frequencies.
        sections: frequencies per axis, summing to r/2 (Qwen2-VL: (16, 24, 24); Qwen3-VL: (24, 20, 20)).
        interleaved: Qwen3-VL's interleaved assignment instead of contiguous sections.
        attention_factor: multiplier on cos and sin.
        precision: "float32" or "exact" (see `posenc.rope.tables`).
    Returns:
        `(cos, sin)`, float32, `[b, t, r/2]` or `[t, r/2]`.
    Raises:
        PosencError: positions not `[3, ...]` integers, or sections that do not sum to r/2.

        >>> cos, sin = mrope_cos_sin(torch.zeros(3, 1, 5, dtype=torch.long), torch.ones(4), (2, 1, 1))
        >>> cos.shape, float(cos.min()), float(sin.abs().max())
        (torch.Size([1, 5, 4]), 1.0, 0.0)
    """
    check_float_tensor("inv_freq", inv_freq, ndim=(1,))
    position_ids = positions("position_ids", position_ids, shapes=[(3, "b", "t"), (3, "t")], allow_negative=True,
                             device=inv_freq.device)
    axis_map = mrope_axis_map(sections, interleaved)  # [r/2]
    if inv_freq.ndim != 1 or axis_map.numel() != inv_freq.numel():
        fail("sections", f"sections summing to r/2 = {inv_freq.shape[-1]} (one per inverse frequency)", list(sections))
    theta = tables.angles(position_ids, inv_freq, precision)  # [3, ..., r/2]
    return tables.cos_sin_from_angles(gather_axes(theta, axis_map), attention_factor)  # [..., r/2]
