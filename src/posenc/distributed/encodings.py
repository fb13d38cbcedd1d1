"""Encodings on a rank that holds a shard: everything from global positions, heads from the rank's slice.

- RoPE / M-RoPE: rotate the rank's tokens at their global position ids; a length-dependent scaling
  (dynamic NTK, LongRoPE) must see the GLOBAL length, which a shard cannot infer from its own ids
  (`max(local ids) + 1` is wrong on every contiguous rank but the last). `shard_cos_sin` is the table
  TransformerEngine's `apply_rotary_pos_emb(cp_size, cp_rank)` and Megatron's `get_pos_emb_on_this_cp_rank`
  slice out of the full one.
- ALiBi / T5: the bias of a block is `scheme.bias(q_positions, k_positions)` with the global positions of
  the queries and of the keys being processed (never block-local offsets).
- Ulysses: a rank owns a slice of heads after the all-to-all; `HeadSlice` gives its bias and `score_mod`.

    >>> import torch, posenc
    >>> alibi = posenc.ALiBi(8)
    >>> part = HeadSlice(alibi, slice(2, 4))
    >>> q, k = torch.arange(4), torch.arange(4)
    >>> torch.equal(part.bias(q, k), alibi.bias(q, k)[2:4])
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..attention import encode_qk
from ..errors import batch_positions, fail
from ..rope.spec import Rope
from .collectives import global_max
from .layouts import shard_positions

__all__ = ["HeadSlice", "shard_cos_sin", "encode_shard"]


@dataclass(frozen=True)
class HeadSlice:
    """A bias scheme restricted to the global heads `heads` (a Ulysses or tensor-parallel rank's heads).

    Args:
        scheme: a bias scheme with `bias(q_positions, k_positions)` and `score_mod(...)` over all heads.
        heads_slice: `slice(start, stop)` of global heads (see `posenc.distributed.head_slice`).
    Raises:
        PosencError: a slice with a step, or outside the scheme's heads.
    """

    scheme: Any
    heads_slice: slice

    def __post_init__(self) -> None:
        total = getattr(self.scheme, "heads", None)
        s = self.heads_slice
        if (not isinstance(s, slice) or s.step not in (None, 1) or not isinstance(s.start, int)
                or not isinstance(s.stop, int) or not 0 <= s.start < s.stop or (total and s.stop > total)):
            fail("heads_slice", f"slice(start, stop) within the scheme's {total} heads", s)

    @property
    def heads(self) -> int:
        """The number of heads this slice covers."""
        return self.heads_slice.stop - self.heads_slice.start

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """`[h, tq, tk]` or `[b, h, tq, tk]`: the scheme's bias on these heads (gradients reach the full table)."""
        return self.scheme.bias(q_positions, k_positions)[..., self.heads_slice, :, :]

    def score_mod(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The scheme's `score_mod` with local head `h` read as global head `start + h`."""
        inner, start = self.scheme.score_mod(q_positions, k_positions), self.heads_slice.start
        return lambda score, b, h, q_idx, kv_idx: inner(score, b, h + start, q_idx, kv_idx)


def shard_cos_sin(rope: Rope, seq_len: int, cp_size: int, cp_rank: int, layout: str = "zigzag",
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the cos/sin table of a length-`seq_len` sequence (global length for the scaling).

    Returns:
        float32 `(cos, sin)`, `[S / W, r / 2]`, equal to the rows `shard_positions(...)` of the full table.
    Raises:
        PosencError: as `shard_positions`, or a non-Rope `rope`.
    """
    if not isinstance(rope, Rope):
        fail("rope", "a posenc.Rope", rope)
    positions = shard_positions(seq_len, cp_size, cp_rank, layout)  # [S/W]
    return rope.cos_sin(positions, seq_len=seq_len)


def _length(rope: Rope, positions: torch.Tensor, seq_len: int | None, group: Any) -> int | None:
    """The length a length-dependent scaling sees: `seq_len`, else max over the group of the ids, plus 1."""
    if seq_len is not None or not rope.scaling.depends_on_length:
        return seq_len
    local = int(positions.max()) if positions.numel() else -1
    # a collective: every rank holds the same encoding, so every rank calls it
    return global_max(local, group, positions.device) + 1


def encode_shard(encoding: Any, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor,
                 k_positions: torch.Tensor, *, seq_len: int | None = None, group: Any = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """`posenc.attention.encode_qk` on this rank's shard: RoPE sees the global length.

    The length a length-dependent scaling uses is `seq_len` if given, else the group's
    `max(q and k ids) + 1` (the rule of single-process `posenc.attention`: one table for q and k), found
    with all-reduces that every rank runs (same encoding everywhere, so the collective sequence is symmetric).

    Returns:
        `(q, k, bias scheme or None)`.
    Raises:
        PosencError: as `encode_qk`.
    """
    b, tq, tk = q.shape[0], q.shape[2], k.shape[2]
    q_pos = batch_positions("q_positions", q_positions, b, tq, device=q.device)  # [b, tq]
    k_pos = batch_positions("k_positions", k_positions, b, tk, device=q.device)  # [b, tk]
    length = None
    if isinstance(encoding, Rope):
        lengths = (_length(encoding, q_pos, seq_len, group), _length(encoding, k_pos, seq_len, group))
        length = None if lengths[0] is None else max(lengths)
    return encode_qk(encoding, q, k, q_pos, k_pos, q_positions, k_positions, length)
