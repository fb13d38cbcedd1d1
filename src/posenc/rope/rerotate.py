"""Re-rotation: turn keys already rotated at one (position, table) into keys at another, without
recomputing them (context shift, StreamingLLM eviction, a dynamic-NTK or LongRoPE table switch).

The 2x2 map per pair is `R_new @ R_old^-1`, built from the very float32 tables a forward uses, so the
result equals the key a forward computes at the new position and table to float64 rounding of the map.

    >>> import torch, posenc
    >>> rope = posenc.Rope(head_dim=8)
    >>> k = torch.randn(1, 2, 3, 8)                                   # [b, h, t, d]
    >>> old, new = torch.tensor([10, 11, 12]), torch.tensor([0, 1, 2])
    >>> moved = rerotate(rope, rope.rotate(k, old), old, new)
    >>> bool(torch.allclose(moved, rope.rotate(k, new), atol=1e-6))
    True
"""

from __future__ import annotations

import torch

from ..errors import batch_positions, check_float_tensor, fail
from .apply import apply_rope
from .spec import Rope

__all__ = ["rerotate", "row_tables", "rerotation_tables", "stored_pairing"]


def row_tables(rope: Rope, positions: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row RoPE tables: row i uses the table of sequence length `seq_lens[i]`.

    Args:
        rope: the embedding.
        positions: `[b, t]` integer positions (negative entries, empty slots, are read as 0).
        seq_lens: `[b]` int64 lengths (only used by length-dependent scalings).
    Returns:
        `(cos, sin)` float32 `[b, t, r/2]`, attention factor applied, equal to `rope.cos_sin(row, seq_len=L)`.
    """
    positions = positions.clamp(min=0)  # [b, t]; empty slots get a harmless angle, they are masked
    if not rope.scaling.depends_on_length:
        return rope.cos_sin(positions)
    half = rope.rotary_dim // 2
    cos = torch.empty(*positions.shape, half, dtype=torch.float32, device=positions.device)  # [b, t, r/2]
    sin = torch.empty_like(cos)
    for length in seq_lens.unique().tolist():  # one table per distinct length, never the batch maximum
        rows = seq_lens == length
        cos[rows], sin[rows] = rope.cos_sin(positions[rows], seq_len=int(length))
    return cos, sin


def rerotation_tables(
    rope: Rope, old_positions: torch.Tensor, new_positions: torch.Tensor, old_lens: torch.Tensor, new_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 `[b, t, r/2]` tables that turn a key rotated by the old table into the new one.

    The 2x2 map per pair is `R_new @ R_old^-1`, built from the very float32 tables a forward uses
    (`c = a cos(p w)`, `s = a sin(p w)`, attention factor `a` included), so the result equals the key a
    forward computes with the new table to float64 rounding. It is the rotation by the phase difference
    `p_new w_new - p_old w_old`, scaled by `a_new / a_old`; rotating by `cos/sin(delta)` from fresh
    angles instead would leave the float32 rounding of both tables (~1e-7) in the key.
    """
    c_old, s_old = (x.double() for x in row_tables(rope, old_positions, old_lens))  # [b, t, r/2]
    c_new, s_new = (x.double() for x in row_tables(rope, new_positions, new_lens))
    norm = c_old * c_old + s_old * s_old  # a_old^2 (up to the tables' rounding), never 0
    return (c_new * c_old + s_new * s_old) / norm, (s_new * c_old - c_new * s_old) / norm


def stored_pairing(rope: Rope) -> str:
    """The pairing of keys as stored after rotation (DeepSeek-V3 writes interleaved input back split-half)."""
    return "split_half" if rope.pairing == "interleaved_to_split_half" else rope.pairing


def rerotate(
    rope: Rope,
    k: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    *,
    old_seq_len: int | None = None,
    new_seq_len: int | None = None,
) -> torch.Tensor:
    """Keys rotated by `rope` at `old_positions` (table of `old_seq_len`), moved to `new_positions` (table
    of `new_seq_len`).

    Args:
        rope: the embedding the keys were rotated with.
        k: `[b, h, t, d]` rotated keys (layout "bhtd").
        old_positions, new_positions: `[t]` or `[b, t]` integer positions.
        old_seq_len, new_seq_len: lengths for length-dependent scalings (default: `max(positions) + 1` of each).
    Returns:
        `[b, h, t, d]` keys in k's dtype (the map is applied in float64 for float64 keys, else float32).
    Raises:
        PosencError: a `rope` that is not a Rope, keys that are not `[b, h, t, head_dim]` floats, positions that are not integer `[t]` or
            `[b, t]` (b of k, or 1) on k's device, negative positions.
    """
    if not isinstance(rope, Rope):
        fail("rope", "a posenc.Rope (the embedding the keys were rotated with)", type(rope))
    check_float_tensor("k", k, ndim=(4,))
    if k.shape[-1] != rope.head_dim:  # a narrower key would be half-rotated with the wrong pairs
        fail("k", f"last dim = head_dim = {rope.head_dim} (the Rope's)", k)
    b, t = k.shape[0], k.shape[-2]
    old_p, new_p = (batch_positions(arg, p, b, t, allow_negative=False, device=k.device)  # [b, t]
                    for arg, p in (("old_positions", old_positions), ("new_positions", new_positions)))
    lens = [torch.full((b,), rope.seq_len_for(p, n) or 0, dtype=torch.int64, device=k.device) for p, n in
            ((old_p, old_seq_len), (new_p, new_seq_len))]
    cos, sin = rerotation_tables(rope, old_p, new_p, lens[0], lens[1])  # [b, t, r/2] float64
    return apply_rope(k, cos, sin, pairing=stored_pairing(rope))  # float64 maps, applied in k's compute dtype
