"""ALiBi: a per-head linear penalty on the query-key distance, from explicit logical positions.

Slopes (Press et al., 2022): for a power of two `n` heads, slope_i = 2**(-8 i / n), i = 1..n. For other
head counts, with n = 2**floor(log2 H), the first n heads take the n-head slopes and the remaining H - n
heads take every other slope of the 2n-head series, 2**(-4 (2j - 1) / n), j = 1..H-n. This equals
BLOOM's and MPT's slopes (the naive 2**(-8 h / H) does not, for H not a power of two).

Bias convention (added to the scaled scores `q.k * scale`):
- causal form (decoders): `-slope * (q_pos - k_pos)`. Under softmax this equals BLOOM's `slope * k_pos`
  (the two differ by `slope * q_pos`, constant along a query row). Keys after the query get a positive
  bias, so use it with a causal mask.
- symmetric form (encoders): `-slope * |q_pos - k_pos|`.

Because the bias is computed from positions, it is right under a KV cache (queries at positions
L, L+1, ...), a left-padded batch (per-row positions) and a sequence shard (a rank's slice of positions).
A tensor-parallel rank `rank` of `world_size` holds heads `[rank * H / W, (rank + 1) * H / W)`.

    >>> import torch
    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    >>> alibi_bias(1, torch.tensor([2]), torch.arange(3)).tolist()   # slope 1/256, query at 2
    [[[-0.0078125, -0.00390625, -0.0]]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import fail, integer, positions

__all__ = ["alibi_slopes", "alibi_bias", "alibi_head_slice", "ALiBi"]


def _check_heads(num_heads: Any, rank: Any, world_size: Any) -> None:
    """The one check of a head count and a tensor-parallel (rank, world_size)."""
    num_heads, world_size = integer("num_heads", num_heads, min=1), integer("world_size", world_size, min=1)
    if num_heads % world_size:
        fail("world_size", f"a divisor of num_heads={num_heads}", world_size)
    integer("rank", rank, min=0, max=world_size - 1, what=f"an integer in [0, world_size={world_size})")


def alibi_head_slice(num_heads: int, world_size: int = 1, rank: int = 0) -> slice:
    """The global heads a tensor- or sequence-parallel rank holds: `slice(rank * H / W, (rank + 1) * H / W)`.

    The group size comes before the rank, as everywhere in posenc (`shard_positions(seq_len, cp_size, cp_rank)`);
    `posenc.distributed.head_slice` is this function.

        >>> alibi_head_slice(12, 4, 2)
        slice(6, 9, None)

    Raises:
        PosencError: non-positive heads or world size, a world size that does not divide the heads, a bad rank.
    """
    _check_heads(num_heads, rank, world_size)
    local = int(num_heads) // int(world_size)
    return slice(int(rank) * local, (int(rank) + 1) * local)


def alibi_slopes(num_heads: int, *, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """ALiBi slopes for any head count (paper rule; equal to BLOOM's and MPT's).

    Args:
        num_heads: total heads H of the layer (>= 1).
        rank, world_size: return only the slopes of this tensor-parallel rank's heads.
    Returns:
        `[H / world_size]` float32 slopes, strictly positive and decreasing within each series.
    Raises:
        PosencError: zero or negative heads, a world size that does not divide H, a bad rank.
    """
    heads = alibi_head_slice(num_heads, world_size, rank)
    num_heads = int(num_heads)
    n = 2 ** int(math.floor(math.log2(num_heads)))
    # BLOOM's arithmetic (float32 base raised to integer powers), so the slopes equal transformers' BLOOM
    # bit for bit; the float64 closed form rounded once differs from it by at most 1 ulp for some H.
    base = torch.tensor(2 ** (-(2 ** -(math.log2(n) - 3))), dtype=torch.float32)  # 2**(-8/n)
    slopes = torch.pow(base, torch.arange(1, 1 + n, dtype=torch.int32))  # [n]
    if n != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * n) - 3))), dtype=torch.float32)  # 2**(-4/n)
        extra_powers = torch.arange(1, 1 + 2 * (num_heads - n), 2, dtype=torch.int32)  # [H - n] odd powers
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)])  # [H]
    return slopes[heads]  # [H / world_size]


def _pos(arg: str, x: Any) -> torch.Tensor:
    """`[t]` or `[b, t]` integer positions as int64; negative ones are fine, only differences matter."""
    return positions(arg, x, shapes=[("t",), ("b", "t")], allow_negative=True).long()


def relative_distance(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """`q_pos - k_pos` as int64, `[tq, tk]` or `[b, tq, tk]` (batch from whichever argument has one)."""
    q = _pos("q_positions", q_positions)
    k = _pos("k_positions", k_positions).to(q.device)
    if q.ndim == 2 and k.ndim == 2 and q.shape[0] != k.shape[0] and 1 not in (q.shape[0], k.shape[0]):
        fail("k_positions", f"batch size 1 or {q.shape[0]} (as q_positions)", k_positions)
    return q[..., :, None] - k[..., None, :]  # [b?, tq, tk]


def position_lookup(positions: torch.Tensor) -> Callable[[Any, Any], torch.Tensor]:
    """For a FlexAttention `score_mod`: map (batch index, token index) to the logical position."""
    if positions.ndim == 1:
        return lambda b, idx: positions[idx]
    if positions.shape[0] == 1:
        return lambda b, idx: positions[0, idx]
    return lambda b, idx: positions[b, idx]


def alibi_bias(
    num_heads: int,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    symmetric: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> torch.Tensor:
    """The ALiBi bias for explicit query and key positions (see the module docstring for the convention).

    Args:
        num_heads: total heads H of the layer.
        q_positions: `[tq]` or `[b, tq]` integer logical positions of the queries.
        k_positions: `[tk]` or `[b, tk]` integer logical positions of the keys.
        symmetric: `-slope * |q - k|` (encoders) instead of the causal `-slope * (q - k)`.
        rank, world_size: only this tensor-parallel rank's heads.
    Returns:
        float32 `[h, tq, tk]`, or `[b, h, tq, tk]` when either positions tensor has a batch axis.
    Raises:
        PosencError: bad head counts, non-integer or badly shaped positions.
    """
    distance = relative_distance(q_positions, k_positions)  # [b?, tq, tk] int64
    slopes = alibi_slopes(num_heads, rank=rank, world_size=world_size).to(distance.device)  # [h]
    if symmetric:
        distance = distance.abs()
    # fp32: distances are exact integers below 2**24
    return -slopes[:, None, None] * distance.float().unsqueeze(-3)  # [b?, h, tq, tk]


@dataclass(frozen=True)
class ALiBi:
    """ALiBi as an encoding value for `posenc.attention` (bias, and a FlexAttention `score_mod`).

    Args:
        num_heads: total heads H of the layer.
        symmetric: encoder form `-slope * |q - k|` (default: causal form `-slope * (q - k)`).
        rank, world_size: the tensor-parallel rank whose heads this value covers.
    Raises:
        PosencError: bad head counts or rank.

        >>> import torch
        >>> ALiBi(8).bias(torch.arange(3), torch.arange(3)).shape
        torch.Size([8, 3, 3])
    """

    num_heads: int
    symmetric: bool = False
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        _check_heads(self.num_heads, self.rank, self.world_size)

    @property
    def heads(self) -> int:
        """The number of heads this value covers (H / world_size)."""
        return self.num_heads // self.world_size

    @property
    def slopes(self) -> torch.Tensor:
        """`[heads]` float32 slopes of this rank's heads."""
        return alibi_slopes(self.num_heads, rank=self.rank, world_size=self.world_size)

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """`[h, tq, tk]` or `[b, h, tq, tk]` float32 bias (see `alibi_bias`)."""
        return alibi_bias(
            self.num_heads, q_positions, k_positions,
            symmetric=self.symmetric, rank=self.rank, world_size=self.world_size,
        )

    def score_mod(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> Callable[..., torch.Tensor]:
        """A FlexAttention `score_mod(score, b, h, q_idx, kv_idx)` adding this bias, from positions only.

        Args:
            q_positions: `[tq]` or `[b, tq]`; k_positions: `[tk]` or `[b, tk]` (integer).
        Returns:
            The callable; no `[tq, tk]` tensor is built.
        """
        q, k = _pos("q_positions", q_positions), _pos("k_positions", k_positions)
        q_at, k_at = position_lookup(q), position_lookup(k.to(q.device))
        slopes = self.slopes.to(q.device)  # [h]
        symmetric = self.symmetric

        def score_mod(score, b, h, q_idx, kv_idx):
            distance = q_at(b, q_idx) - k_at(b, kv_idx)
            if symmetric:
                distance = distance.abs()
            return score - slopes[h] * distance.to(torch.float32)

        return score_mod
