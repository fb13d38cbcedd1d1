"""What an encoding does to q, k and the scores in `posenc.attention`: classify it, check it fits, apply it.

A `Rope` rotates q and k with one table per batch row (that of the forward's length); an absolute scheme adds
its embedding to q and k; a bias scheme is handed back for the scores (`_bias_4d` makes its `[b or 1, h, tq, tk]`
tensor). A query temperature (`apply_temperature`) scales q after the encoding.

Neighbours: `posenc.attention` (the entry point `attention` and its argument checks, which re-exports these
names) and `posenc.attention.masks` (the logical masks and the fused sdpa / flex paths).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import Raw, assert_values, fail
from ..rope import dispatch
from ..rope.rerotate import row_tables
from ..rope.spec import Rope
from ..rope.temperature import QueryTemperature

__all__ = ["encoding_kind", "check_encoding", "encode_qk", "apply_temperature"]


def encoding_kind(encoding: Any) -> str:
    """Classify an encoding: "none", "rope", "bias" or "absolute" (raises PosencError otherwise)."""
    if encoding is None:
        return "none"
    if isinstance(encoding, Rope):
        return "rope"
    if callable(getattr(encoding, "bias", None)) and callable(getattr(encoding, "score_mod", None)):
        return "bias"
    if callable(getattr(encoding, "embedding", None)):
        return "absolute"
    fail("encoding", "None, a posenc.Rope, a bias scheme (ALiBi, T5RelativeBias) or an absolute scheme", encoding)


def check_encoding(encoding: Any, q: torch.Tensor) -> str:
    """Check that `encoding` fits q (a bias scheme's heads, a Rope's width); return its kind."""
    hq, d = q.shape[1], q.shape[-1]
    kind = encoding_kind(encoding)
    if kind == "bias" and getattr(encoding, "heads", hq) != hq:
        fail("encoding", f"a bias scheme covering hq={hq} heads", Raw(f"one covering {encoding.heads}"))
    if kind == "rope" and encoding.head_dim != d:
        fail("encoding", f"a Rope with head_dim={d} (the width of q and k)", encoding)
    return kind


def encode_qk(encoding: Any, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              q_positions: torch.Tensor, k_positions: torch.Tensor, seq_len: int | None = None,
              table: Any = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Apply an encoding's effect on q and k; return `(q, k, bias scheme or None)`.

    A Rope rotates q and k with ONE table per row, that of the forward's length: `seq_len` if given (the
    global length under context parallelism), else `max(q and k positions of the row) + 1`, as a full
    forward in transformers. An absolute scheme adds its embedding; a bias scheme is returned for the scores.

    Args:
        q_pos, k_pos: int64 `[b, tq]`, `[b, tk]` positions (from `check_inputs`).
        q_positions, k_positions: the positions as given (`[t]` or `[b, t]`) for absolute tables.
    Raises:
        PosencError: an unknown encoding, a bias scheme for another head count, a bad width, negative
            positions under a Rope.
    """
    kind = check_encoding(encoding, q)
    if kind == "rope":
        q, k = _rotate(encoding, q, k, q_pos, k_pos, seq_len, table)
    elif kind == "absolute":
        d = q.shape[-1]
        q = q + _absolute(encoding, q_positions, d).unsqueeze(-3).to(q.dtype)  # [b?, 1, tq, d]
        k = k + _absolute(encoding, k_positions, d).unsqueeze(-3).to(k.dtype)  # [b?, 1, tk, d]
    return q, k, encoding if kind == "bias" else None


def _rotate(rope: Rope, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            seq_len: int | None = None, table: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated with one table per row, that of length `seq_len` or `max(q and k positions) + 1`.

    Through the dispatch (`rope.dispatch`), like every rotation; `table`: a `RopeTable` of `rope` to read rows from.
    """
    for arg, pos in (("q_positions", q_pos), ("k_positions", k_pos)):  # on the device: no host sync
        assert_values(arg, (pos >= 0).all(), "positions >= 0 (a Rope rotates by the position)",
                      lambda pos=pos: Raw(f"min {int(pos.min())}"))
    if not rope.scaling.depends_on_length:  # one table whatever the length: the fast path (kernels)
        if table is not None:
            return rope.rotate(q, q_pos, table=table), rope.rotate(k, k_pos, table=table)
        # no table: the angles of q's and k's positions made once (one product, one cos, one sin for both)
        tq = q_pos.shape[-1]
        cos, sin = rope.cos_sin(torch.cat((q_pos, k_pos), -1), allow_negative=True)  # [b, tq + tk, r/2] (checked)
        return (dispatch.rotate(q, None, cos[:, :tq], sin[:, :tq], None, rope.pairing)[0],
                dispatch.rotate(k, None, cos[:, tq:], sin[:, tq:], None, rope.pairing)[0])
    if seq_len is not None:
        lengths = torch.full((q_pos.shape[0],), int(seq_len), dtype=torch.long, device=q_pos.device)  # [b]
    else:
        lengths = torch.maximum(q_pos.amax(dim=1), k_pos.amax(dim=1)) + 1  # [b]: the forward's length per row
    cos_q, sin_q = row_tables(rope, q_pos, lengths)  # [b, tq, r/2]
    cos_k, sin_k = row_tables(rope, k_pos, lengths)  # [b, tk, r/2]
    return (dispatch.rotate(q, None, cos_q, sin_q, None, rope.pairing)[0],
            dispatch.rotate(k, None, cos_k, sin_k, None, rope.pairing)[0])


def _absolute(encoding: Any, positions: torch.Tensor, d: int) -> torch.Tensor:
    emb = encoding.embedding(positions)  # [t, d] or [b, t, d]
    if emb.shape[-1] != d:
        fail("encoding", f"an absolute embedding of width d={d}", emb)
    return emb


def _bias_4d(scheme: Any, q_positions: torch.Tensor, k_positions: torch.Tensor, heads: int) -> torch.Tensor:
    bias = scheme.bias(q_positions, k_positions)  # [h, tq, tk] or [b, h, tq, tk]
    if bias.shape[-3] != heads:
        fail("encoding", f"a bias scheme for hq={heads} heads", bias)
    return bias if bias.ndim == 4 else bias.unsqueeze(0)  # [b or 1, h, tq, tk]


def apply_temperature(temperature: QueryTemperature, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """`q [b, hq, t, d]` times `temperature.scale(q_pos [b, t])` (float32 factors; the product in q's dtype).

    Raises:
        PosencError: negative positions.
    """
    assert_values("q_positions", (q_pos >= 0).all(), "positions >= 0 (a query temperature grows with the position)",
                  lambda: Raw(f"min {int(q_pos.min())}"))
    factor = temperature.scale(q_pos).to(q.device)  # [b, t] float32, as Llama 4 and Ministral 3 compute it
    return (q * factor[:, None, :, None]).to(q.dtype)  # [b, hq, t, d]
