"""posenc on PyTorch's own context parallelism (`torch.distributed.tensor.experimental`, torch >= 2.7).

What PyTorch does: it rearranges and shards "buffers" along their sequence dimension (head-tail load
balancing = posenc's "zigzag" when `S % 2W == 0`, silently no balancing otherwise) and, on the
FlexAttention path, all-gathers K and V in rank order. Its SDPA ring rejects any attention bias, and
on the flex path it rewrites a `BlockMask`'s `mask_mod` to global indices but NOT a `score_mod`: a
`score_mod` written on `q_idx / kv_idx` (local query index, index into the gathered keys) computes
ALiBi and T5 at the wrong distances.

The recipe (docs/distributed.md shows it whole):
1. Hand a position tensor to PyTorch as one more buffer (`shard_buffers` or `context_parallel(...,
   buffers=[..., positions])`), so positions follow PyTorch's rearrangement whatever it chose.
2. Rotate q and k on the shard at those positions (RoPE / M-RoPE; global length for dynamic scalings).
3. Build the `score_mod` from positions: this rank's query positions, and the key positions gathered
   in the same rank order as PyTorch gathers K/V (`flex_cp_attention` does 2 and 3, and calls flex
   through PyTorch's `_ContextParallel(FLEX)` wrapper).

The private names used here are imported inside functions; a torch without them raises PosencError.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..attention import check_inputs, flex_score_mod
from ..errors import fail
from .collectives import all_gather_seq
from .encodings import encode_shard
from .layouts import SHARD_LAYOUTS

__all__ = ["load_balancer", "shard_buffers", "flex_cp_module", "flex_cp_attention"]


def _cp_private() -> Any:
    try:
        from torch.distributed.tensor.experimental import _context_parallel as cp
    except ImportError:  # pragma: no cover - torch < 2.7
        fail("torch", "a version with torch.distributed.tensor.experimental._context_parallel (>= 2.7)",
             torch.__version__)
    return cp


def load_balancer(layout: str, seq_len: int, mesh: Any) -> Any:
    """PyTorch's load balancer for a posenc layout: zigzag -> `_HeadTailLoadBalancer`, contiguous -> None.

    Raises:
        PosencError: an unknown layout, or a zigzag length PyTorch would silently not balance (not 2W-divisible).
    """
    if layout not in SHARD_LAYOUTS:
        fail("layout", f"one of {SHARD_LAYOUTS}", layout)
    if layout == "contiguous":
        return None
    if seq_len % (2 * mesh.size()):
        fail("seq_len", f"a multiple of 2 * cp_size = {2 * mesh.size()} for the zigzag (head-tail) layout", seq_len)
    return _cp_private()._HeadTailLoadBalancer(seq_len, mesh.size(), mesh.device_type)


def shard_buffers(mesh: Any, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], layout: str = "zigzag",
                  ) -> list[torch.Tensor]:
    """Shard tensors (q, k, v, labels, POSITIONS, ...) with PyTorch's own CP sharding and the layout's balancer.

    Args:
        mesh: the 1-D context-parallel `DeviceMesh`.
        buffers: tensors sharing one sequence length along their `seq_dims`.
        layout: "zigzag" (head-tail) or "contiguous".
    Returns:
        This rank's shards, in order (PyTorch's `_context_parallel_shard`).
    """
    if not buffers or len(buffers) != len(seq_dims):
        fail("seq_dims", f"one sequence dimension per buffer ({len(buffers)})", list(seq_dims))
    seq_len = buffers[0].shape[seq_dims[0]]
    return _cp_private()._context_parallel_shard(mesh, list(buffers), list(seq_dims),
                                                 load_balancer=load_balancer(layout, seq_len, mesh))


class _Flex(torch.nn.Module):
    """`flex_attention` as a module, so PyTorch's `_ContextParallel(FLEX)` can wrap it (all-gathers K/V)."""

    def forward(self, query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa)


def flex_cp_module(mesh: Any) -> torch.nn.Module:
    """A flex-attention module under PyTorch's `_ContextParallel(FLEX)`: K/V are all-gathered in rank order."""
    cp = _cp_private()
    from torch.distributed.tensor.parallel import parallelize_module

    style = cp._ContextParallel(seq_dim=2, attention_type=cp._ContextParallel.AttentionType.FLEX)
    return parallelize_module(_Flex(), mesh, style)


def flex_cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    mesh: Any,
    encoding: Any = None,
    causal: bool = True,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    seq_len: int | None = None,
    block_mask: Any = None,
    module: torch.nn.Module | None = None,
) -> torch.Tensor:
    """`posenc.attention.attention` on PyTorch's FlexAttention context-parallel path.

    Args:
        q, k, v: this rank's shards `[b, h, t/W, d]` as PyTorch sharded them (`shard_buffers`).
        q_positions, k_positions: `[t/W]` or `[b, t/W]` positions sharded WITH them (a buffer of the same call).
        mesh: the 1-D CP `DeviceMesh`.
        encoding, causal, key_mask (`[b, t/W]`), scale, window: as `posenc.attention`; biases and masks come
            from positions in the `score_mod`, so they are right under any rearrangement.
        seq_len: the length a length-dependent RoPE scaling uses (default: the group's `max(ids) + 1`).
        block_mask: optional PyTorch CP block mask (sparsity only; posenc's masks are in the `score_mod`).
        module: a `flex_cp_module(mesh)` to reuse (default: a new one).
    Returns:
        `[b, hq, t/W, dv]`, this rank's rows of the single-process result.
    """
    q_pos, k_pos, scale = check_inputs(q, k, v, q_positions, k_positions, key_mask, scale, window)  # [b, t]
    group = mesh.get_group()
    q, k, scheme = encode_shard(encoding, q, k, q_positions, k_positions, seq_len=seq_len, group=group)
    k_all = all_gather_seq(k_pos, 1, group)  # [b, S]: the order PyTorch gathers K/V in
    mask_all = None if key_mask is None else all_gather_seq(key_mask, 1, group)
    score_mod = flex_score_mod(q_pos, k_all, scheme, causal, mask_all, window)
    module = module if module is not None else flex_cp_module(mesh)
    return module(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                  enable_gqa=q.shape[1] != k.shape[1])  # [b, hq, t/W, dv]
