"""T5 relative position buckets and the learned per-head bias looked up from them.

`relative_position = k_pos - q_pos` (memory minus context, as T5). Buckets, for `num_buckets` B:
- bidirectional (encoder): half the buckets for keys after the query (offset B/2), half for keys before;
  within a half of size N = B/2, distance n = |rel|.
- causal (decoder): N = B, n = max(-rel, 0) (keys after the query share bucket 0).
- with `max_exact = N / 2`: n < max_exact -> bucket n; else
  `max_exact + floor(log(n / max_exact) / log(max_distance / max_exact) * (N - max_exact))`, capped at N - 1.

The float32 operations are those of transformers' `T5Attention._relative_position_bucket`, so the buckets
are equal; `log(0)` (undefined behaviour there, masked afterwards) is avoided by clamping the large branch.
The bias is a pure function of positions, so the row of a query decoded with a KV cache equals the same
row of the full-sequence bias.

    >>> import torch
    >>> t5_relative_position_bucket(torch.tensor([-20, -1, 0, 1, 20, 128])).tolist()
    [10, 1, 0, 17, 26, 31]
    >>> t5_relative_position_bucket(torch.tensor([-20, 5]), bidirectional=False).tolist()
    [17, 0]
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from ..errors import boolean, fail, integer, positions
from .alibi import _pos, position_lookup, relative_distance

__all__ = ["t5_relative_position_bucket", "T5RelativeBias"]


def _check_buckets(bidirectional: Any, num_buckets: Any, max_distance: Any) -> tuple[int, int]:
    """Return (buckets per direction N, max_exact) after checking the parameters."""
    bidirectional = boolean("bidirectional", bidirectional)
    num_buckets = integer("num_buckets", num_buckets)
    if bidirectional and (num_buckets < 4 or num_buckets % 2):
        fail("num_buckets", "an even integer >= 4 (bidirectional: half the buckets per direction)", num_buckets)
    if not bidirectional and num_buckets < 2:
        fail("num_buckets", "an integer >= 2", num_buckets)
    per_direction = num_buckets // 2 if bidirectional else num_buckets
    max_exact = per_direction // 2
    mode = "bidirectional" if bidirectional else "causal"
    integer("max_distance", max_distance, min=max_exact + 1,
            what=f"an integer > {max_exact} (the exact-bucket range, {mode} mode)")
    return per_direction, max_exact


def _bucket(relative_position: torch.Tensor, bidirectional: bool, per_direction: int, max_exact: int,
            max_distance: int) -> torch.Tensor:
    """The bucket formula in elementwise torch ops only (so it also runs inside a FlexAttention score_mod)."""
    if bidirectional:
        offset = (relative_position > 0).to(torch.long) * per_direction
        distance = relative_position.abs()
    else:
        offset = torch.zeros_like(relative_position)
        distance = (-relative_position).clamp(min=0)
    # clamp keeps log() finite; the clamped entries take the small branch anyway
    large = max_exact + (
        torch.log(distance.clamp(min=max_exact).float() / max_exact)
        / math.log(max_distance / max_exact)
        * (per_direction - max_exact)
    ).to(torch.long)
    large = large.clamp(max=per_direction - 1)
    return offset + torch.where(distance < max_exact, distance, large)


def t5_relative_position_bucket(
    relative_position: torch.Tensor,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """T5's bucket of each relative position `k_pos - q_pos` (equal to transformers' T5).

    Args:
        relative_position: integer tensor of any shape `[...]`, key position minus query position.
        bidirectional: encoder buckets (both directions) or causal decoder buckets.
        num_buckets: total buckets (bidirectional: even and >= 4; causal: >= 2).
        max_distance: distance from which every bucket is the last one; must exceed the exact range
            (`num_buckets / 4` bidirectional, `num_buckets / 2` causal).
    Returns:
        int64 buckets in `[0, num_buckets)`, shape `[...]`.
    Raises:
        PosencError: a non-integer tensor, or parameters outside the ranges above.
    """
    relative_position = positions("relative_position", relative_position, allow_negative=True)
    per_direction, max_exact = _check_buckets(bidirectional, num_buckets, max_distance)
    return _bucket(relative_position.long(), bool(bidirectional), per_direction, max_exact, int(max_distance))


class T5RelativeBias(nn.Module):
    """T5's learned relative bias: a `[num_buckets, heads]` table looked up by bucket.

    Args:
        num_heads: heads of the layer.
        num_buckets, max_distance, bidirectional: see `t5_relative_position_bucket`
            (encoder self-attention: bidirectional; decoder self-attention: causal).
    Raises:
        PosencError: zero heads or invalid bucket parameters.

        >>> import torch
        >>> bias = T5RelativeBias(num_heads=4)
        >>> bias.bias(torch.arange(3), torch.arange(5)).shape
        torch.Size([4, 3, 5])
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        num_heads = integer("num_heads", num_heads, min=1)
        self._per_direction, self._max_exact = _check_buckets(bidirectional, num_buckets, max_distance)
        self.num_heads, self.num_buckets = num_heads, int(num_buckets)
        self.max_distance, self.bidirectional = int(max_distance), bool(bidirectional)
        # Same layout as T5's nn.Embedding(num_buckets, n_heads).weight, so checkpoints load directly.
        self.weight = nn.Parameter(torch.randn(num_buckets, num_heads) * num_heads**-0.5)

    @property
    def heads(self) -> int:
        """The number of heads the bias covers."""
        return self.num_heads

    def buckets(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """int64 buckets `[tq, tk]` or `[b, tq, tk]` for explicit positions."""
        relative = -relative_distance(q_positions, k_positions)  # k - q, [b?, tq, tk]
        return _bucket(relative, self.bidirectional, self._per_direction, self._max_exact, self.max_distance)

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """The bias from explicit positions.

        Args:
            q_positions: `[tq]` or `[b, tq]`; k_positions: `[tk]` or `[b, tk]` (integer logical positions).
        Returns:
            float32 `[h, tq, tk]`, or `[b, h, tq, tk]` when either positions tensor has a batch axis.
        """
        values = self.weight.float()[self.buckets(q_positions, k_positions)]  # [b?, tq, tk, h]
        return values.movedim(-1, -3)  # [b?, h, tq, tk]

    def forward(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """Same as `bias`."""
        return self.bias(q_positions, k_positions)

    def score_mod(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> Callable[..., torch.Tensor]:
        """A FlexAttention `score_mod(score, b, h, q_idx, kv_idx)` adding this bias (no `[tq, tk]` tensor).

        Args:
            q_positions: `[tq]` or `[b, tq]`; k_positions: `[tk]` or `[b, tk]` (integer).
        Returns:
            The callable, which gathers `weight[bucket(k_pos - q_pos), h]` per score.
        """
        q, k = _pos("q_positions", q_positions), _pos("k_positions", k_positions)
        q_at, k_at = position_lookup(q), position_lookup(k.to(q.device))
        table = self.weight.float()  # [num_buckets, h]
        args = (self.bidirectional, self._per_direction, self._max_exact, self.max_distance)

        def score_mod(score, b, h, q_idx, kv_idx):
            bucket = _bucket(k_at(b, kv_idx) - q_at(b, q_idx), *args)
            return score + table[bucket, h]

        return score_mod
