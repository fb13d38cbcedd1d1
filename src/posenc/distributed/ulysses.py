"""Reference Ulysses (DeepSpeed sequence parallelism) on stock `torch.distributed`.

Each rank holds `[b, h, t/W, d]` sequence shards. RoPE / absolute tables are applied on the shard at
its global positions (global length for length-dependent scalings); one all-to-all turns q, k and v
into `[b, h/W, t, d]` (rank r owns heads `head_slice(h, W, r)`); the positions and key mask are
all-gathered in the same rank order; `posenc.attention` runs on the rank's heads with the bias of
those heads only (`HeadSlice`: unsliced ALiBi slopes are the classic Ulysses bug); one all-to-all
brings the output back to `[b, h, t/W, dv]`. Both exchanges are single autograd nodes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import attention, check_inputs
from ..errors import fail
from .collectives import all_gather_seq, group_size_rank, heads_to_seq, seq_to_heads
from .encodings import HeadSlice, encode_shard
from .layouts import head_slice

__all__ = ["ulysses_attention"]


def ulysses_attention(
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
    seq_len: int | None = None,
    group: Any = None,
) -> torch.Tensor:
    """`posenc.attention.attention` with Ulysses sequence parallelism over `group`.

    Args:
        q: `[b, hq, tq, d]` this rank's sequence shard; k `[b, hk, tk, d]`, v `[b, hk, tk, dv]`
            (hq and hk divisible by the group size; tq, tk equal on every rank).
        q_positions, k_positions: `[t]` or `[b, t]` GLOBAL integer positions of the shard (any layout).
        encoding, causal, key_mask (`[b, tk]`, this rank's keys), scale, impl, window: as `posenc.attention`.
        seq_len: the length a length-dependent RoPE scaling uses (default: the group's `max(ids) + 1`).
        group: the sequence-parallel process group (default: the world).
    Returns:
        `[b, hq, tq, dv]`: this rank's rows of the single-process result.
    Raises:
        PosencError: as `posenc.attention`; head counts not divisible by the group size; no process group.
    """
    q_pos, k_pos, scale = check_inputs(q, k, v, q_positions, k_positions, key_mask, scale, window)  # [b, t]
    size, rank = group_size_rank(group)
    hq, hk = q.shape[1], k.shape[1]
    if hk % size:
        fail("k", f"a head count divisible by the group size {size} (Ulysses splits heads)", k)
    q, k, scheme = encode_shard(encoding, q, k, q_positions, k_positions, seq_len=seq_len, group=group)
    if scheme is not None:
        scheme = HeadSlice(scheme, head_slice(hq, size, rank))  # this rank's heads of the bias
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        fail("v", f"the dtype of q and k ({q.dtype})", v)
    q, k, v = seq_to_heads(q, k, v, group=group)  # [b, h/W, t, d] each, one exchange
    q_all = all_gather_seq(q_pos, 1, group)  # [b, t] global ids in the gathered (rank) order
    k_all = all_gather_seq(k_pos, 1, group)
    mask_all = None if key_mask is None else all_gather_seq(key_mask, 1, group)  # [b, t]
    out = attention(q, k, v, q_positions=q_all, k_positions=k_all, encoding=scheme, causal=causal,
                    key_mask=mask_all, scale=scale, impl=impl, window=window)  # [b, hq/W, t, dv]
    (out,) = heads_to_seq(out, group=group)  # [b, hq, t/W, dv]
    return out
