"""Multi-axis RoPE (Qwen2-VL family): which position axis drives each frequency.

A multimodal token has three positions (temporal, height, width): `position_ids [3, b, t]`. Each of the
r/2 frequencies is driven by one axis:
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

import torch

from ..errors import fail

__all__ = ["mrope_axis_map", "gather_axes"]


def mrope_axis_map(sections: tuple[int, ...], interleaved: bool = False) -> torch.Tensor:
    """`[sum(sections)]` int64: the position axis driving each frequency.

    Args:
        sections: frequencies per axis, summing to r/2.
        interleaved: Qwen3-VL's interleaved assignment instead of contiguous sections.
    """
    if not sections or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sections):
        fail("mrope_section", "a non-empty list of non-negative integers", sections)
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
