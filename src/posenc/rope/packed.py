"""Positions for packed variable-length batches (`cu_seqlens`, as flash-attention's varlen API).

A packed batch concatenates sequences along one token axis (`layout="thd"`); each sequence restarts at
its own offset (0, or the length already cached for it):

    >>> import torch
    >>> packed_positions(torch.tensor([0, 2, 5]), offsets=torch.tensor([7, 0])).tolist()
    [7, 8, 0, 1, 2]
"""

from __future__ import annotations

import torch

from ..errors import check_int_positions, fail

__all__ = ["packed_positions"]


def packed_positions(cu_seqlens: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """`[total]` int64 positions of a packed batch: `offsets[i] + (0 .. len_i - 1)` for sequence i.

    Args:
        cu_seqlens: `[n + 1]` integer cumulative lengths, starting at 0, non-decreasing.
        offsets: `[n]` integer start position of each sequence (default 0).
    Returns:
        `[cu_seqlens[-1]]` int64 positions, to pass with `layout="thd"`.
    Raises:
        PosencError: a cu_seqlens that is not 1-D, does not start at 0 or decreases; offsets of the wrong shape.
    """
    cu_seqlens = check_int_positions("cu_seqlens", cu_seqlens)  # unsigned as int64: a decrease cannot wrap
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() == 0 or int(cu_seqlens[0]) != 0:
        fail("cu_seqlens", "a 1-D tensor [n + 1] starting at 0", cu_seqlens)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [n]
    if bool((lengths < 0).any()):
        fail("cu_seqlens", "non-decreasing cumulative lengths", cu_seqlens.tolist())
    starts = cu_seqlens[:-1].long()
    if offsets is not None:
        offsets = check_int_positions("offsets", offsets, allow_negative=True)
        if offsets.shape != lengths.shape:
            fail("offsets", f"shape [{lengths.numel()}] (one per sequence)", offsets)
        starts = starts - offsets.long()
    total = int(cu_seqlens[-1])
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths.long(),
                                  output_size=total)  # [total] sequence index of each token
    return torch.arange(total, device=cu_seqlens.device) - starts[seq]  # [total]
