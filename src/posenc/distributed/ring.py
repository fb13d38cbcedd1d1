"""Reference ring attention on stock `torch.distributed`: exact, any layout, any posenc encoding.

Each rank holds a shard of the queries and of the keys/values, with their GLOBAL positions. The K/V
shard travels around the ring together with its positions, key mask and document ids, so every
block's causal mask, window and bias are computed from the positions of the keys actually being
processed (`posenc.attention`'s own `_visible` and the scheme's `bias`). Blocks are merged with an
online softmax whose running maximum is detached (it cancels exactly), so plain autograd gives the
backward: the K/V gradient rides the ring back to its owner.

Rank symmetry (autograd through collectives hangs otherwise): every rank runs the same W-1 shifts,
each shift is one autograd node carrying K and V together, and a block with nothing visible still
enters the graph with weight zero, so every rank runs the same backward collectives in the same order.

This is an oracle and a CPU path, not a kernel: it materialises `[b, h, tq, tk_block]` scores per block.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention.encoding import _bias_4d
from ..attention.masks import _visible
from ..attention import check_inputs
from ..errors import batch_positions, fail
from .collectives import group_size_rank, ring_shift
from .encodings import encode_shard

__all__ = ["ring_attention"]


def _documents(arg: str, ids: Any, b: int, t: int) -> torch.Tensor | None:
    return None if ids is None else batch_positions(arg, ids, b, t)  # [b, t] int64


class _OnlineSoftmax:
    """Running `(sum_j p_j v_j, sum_j p_j, max)` per query row over key blocks, in the compute dtype."""

    def __init__(self, shape: tuple[int, ...], dv: int, dtype: torch.dtype, device: torch.device):
        b, h, tq = shape
        self.acc = torch.zeros(b, h, tq, dv, dtype=dtype, device=device)  # [b, h, tq, dv]
        self.total = torch.zeros(b, h, tq, 1, dtype=dtype, device=device)  # [b, h, tq, 1]
        self.max = torch.full((b, h, tq, 1), float("-inf"), dtype=dtype, device=device)  # detached

    def add(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """Merge one block: `scores` `[b, h, tq, tk]` with -inf where hidden, `values` `[b, h, tk, dv]`."""
        new_max = torch.maximum(self.max, scores.detach().amax(-1, keepdim=True))  # [b, h, tq, 1]
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)  # rows seeing nothing yet
        weights = torch.exp(scores - safe)  # [b, h, tq, tk]; hidden -> 0
        rescale = torch.exp(self.max - safe)  # [b, h, tq, 1]; 0 while the row has seen nothing
        self.acc = self.acc * rescale + weights @ values  # [b, h, tq, dv]
        self.total = self.total * rescale + weights.sum(-1, keepdim=True)
        self.max = new_max

    def touch(self, payload: torch.Tensor) -> None:
        """Keep a skipped block in the autograd graph with weight zero (rank-symmetric backward)."""
        self.acc = self.acc + 0.0 * payload.sum()

    def result(self) -> torch.Tensor:
        """`[b, h, tq, dv]`: the softmax average; rows that saw no key are zeros."""
        return self.acc / torch.where(self.total > 0, self.total, torch.ones_like(self.total))


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    encoding: Any = None,
    causal: bool = True,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    impl: str = "eager",
    window: int | None = None,
    q_documents: torch.Tensor | None = None,
    k_documents: torch.Tensor | None = None,
    seq_len: int | None = None,
    group: Any = None,
) -> torch.Tensor:
    """`posenc.attention.attention` over a sequence sharded across the ranks of `group` (ring pass of K/V).

    Every rank calls it with its shard and the shard's global positions; the result is this rank's
    rows of the single-process attention over the whole sequence. Works for any layout (zigzag,
    contiguous, packed documents): only positions decide masks and biases.

    Args:
        q: `[b, hq, tq, d]` this rank's queries; k `[b, hk, tk, d]`, v `[b, hk, tk, dv]` its keys/values
            (tk equal on every rank; GQA when hq % hk == 0).
        q_positions, k_positions: `[tq]` / `[tk]` or batched, GLOBAL integer positions (`shard_positions`).
        encoding, causal, key_mask (`[b, tk]`, this rank's keys), scale, window: as `posenc.attention`.
        impl: "eager" only (the ring merges its blocks itself; accepted so calls match `posenc.attention`).
        q_documents, k_documents: `[t]` or `[b, t]` document ids for packed sequences (keys are visible only
            inside the query's document; positions then restart per document). Both or neither.
        seq_len: the length a length-dependent RoPE scaling uses (default: the group's `max(ids) + 1`).
        group: the context-parallel process group (default: the world).
    Returns:
        `[b, hq, tq, dv]` in q's dtype (float64 math for float64 inputs, else float32).
    Raises:
        PosencError: as `posenc.attention`, one of q_documents/k_documents without the other, no process group.
    """
    q_pos, k_pos, scale = check_inputs(q, k, v, q_positions, k_positions, key_mask, scale, window)  # [b, t]
    if impl != "eager":
        fail("impl", "'eager' (the reference ring computes its blocks in plain torch)", impl)
    b, hq, tq, _ = q.shape
    hk, tk, dk, dv = k.shape[1], k.shape[2], k.shape[-1], v.shape[-1]
    if (q_documents is None) != (k_documents is None):
        fail("k_documents" if k_documents is None else "q_documents", "document ids for both q and k", None)
    q_doc = _documents("q_documents", q_documents, b, tq)  # [b, tq] or None
    k_doc = _documents("k_documents", k_documents, b, tk)
    size, _ = group_size_rank(group)
    q, k, scheme = encode_shard(encoding, q, k, q_positions, k_positions, seq_len=seq_len, group=group)

    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    query = q.to(compute)
    payload = torch.cat([k.to(compute), v.to(compute)], dim=-1)  # [b, hk, tk, d + dv]: K and V travel as one
    mask_row = torch.ones_like(k_pos) if key_mask is None else key_mask.long()
    side = torch.stack([k_pos, mask_row, k_pos if k_doc is None else k_doc], dim=1)  # [b, 3, tk] int64
    state = _OnlineSoftmax((b, hq, tq), dv, compute, q.device)
    for step in range(size):
        if step:
            payload, side = ring_shift(payload, side, group)  # the block of rank - step, with its positions
        block_pos, block_mask, block_doc = side.unbind(1)  # [b, tk] each
        # the block's own mask (all ones from a rank without one), whatever this rank passed
        visible = _visible(q_pos, block_pos, causal, block_mask.bool(), window)  # [b, 1, tq, tk]
        if q_doc is not None:
            visible = visible & (q_doc[:, None, :, None] == block_doc[:, None, None, :])  # [b, 1, tq, tk]
        if not bool(visible.any()):
            state.touch(payload)
            continue
        keys, values = payload.split([dk, dv], dim=-1)  # [b, hk, tk, d], [b, hk, tk, dv]
        if hq != hk:
            keys, values = keys.repeat_interleave(hq // hk, 1), values.repeat_interleave(hq // hk, 1)  # [b, hq, ...]
        scores = (query @ keys.transpose(-1, -2)) * scale  # [b, hq, tq, tk]
        if scheme is not None:
            scores = scores + _bias_4d(scheme, q_pos, block_pos, hq).to(compute)  # bias at global positions
        state.add(scores.masked_fill(~visible, float("-inf")), values)
    return state.result().to(q.dtype)  # [b, hq, tq, dv]
