"""Which tokens a context-parallel rank holds, as global token indices (= positions of one sequence).

Two layouts, both cutting the sequence dimension of length S over W ranks:
- `"contiguous"`: rank r holds tokens `[r S/W, (r+1) S/W)` (Ulysses, DeepSpeed ALST, plain ring).
- `"zigzag"`: the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W-1-r, in that
  order. This is TransformerEngine's DualChunkSwap, Megatron's `get_batch_on_this_cp_rank`, PyTorch's
  `_HeadTailLoadBalancer` and ring-flash-attention's zigzag: it balances causal work across ranks.

Packed documents (`shard_varlen`) apply the layout inside each document (TransformerEngine's THD
convention): rank r holds, for every document in order, that document's chunks r and 2W-1-r, and
positions restart at 0 in each document.

Positions are data: every rank computes its encodings and biases from these global ids, never from
local indices.

    >>> shard_positions(8, 2, 0).tolist(), shard_positions(8, 2, 1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    >>> shard_positions(8, 2, 1, "contiguous").tolist()
    [4, 5, 6, 7]
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from ..bias.alibi import alibi_head_slice as head_slice  # one function, one argument order
from ..errors import Raw, choice, fail, integer

__all__ = ["SHARD_LAYOUTS", "shard_positions", "shard", "unshard_index", "unshard", "VarlenShard", "shard_varlen",
           "head_slice"]

SHARD_LAYOUTS = ("zigzag", "contiguous")


def _check_grid(cp_size: Any, cp_rank: Any, layout: Any) -> None:
    cp_size = integer("cp_size", cp_size, min=1)
    integer("cp_rank", cp_rank, min=0, max=cp_size - 1, what=f"an integer in [0, cp_size={cp_size})")
    choice("layout", layout, SHARD_LAYOUTS)


def _chunks(seq_len: Any, cp_size: int, layout: str, arg: str = "seq_len") -> int:
    """The number of equal chunks `seq_len` is cut into (W contiguous, 2W zigzag), after checking it divides."""
    n = 2 * cp_size if layout == "zigzag" else cp_size
    what = f"a non-negative multiple of {n} ({layout} layout over cp_size={cp_size})"
    if integer(arg, seq_len, min=0, what=what) % n:
        # PyTorch silently falls back to no balancing here; posenc refuses, so positions never disagree.
        fail(arg, what, seq_len)
    return n


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, layout: str = "zigzag", *,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """This rank's global token indices (the position ids of one unpacked sequence).

    Args:
        seq_len: the global sequence length S (a multiple of 2W for zigzag, of W for contiguous).
        cp_size: context-parallel world size W.
        cp_rank: this rank, in [0, W).
        layout: "zigzag" (chunks r and 2W-1-r of 2W) or "contiguous".
        device: where the result lives.
    Returns:
        int64 `[S / W]`, increasing within each chunk.
    Raises:
        PosencError: a bad size, rank or layout, or a length the layout cannot split evenly.
    """
    _check_grid(cp_size, cp_rank, layout)
    n = _chunks(seq_len, cp_size, layout)
    seq_len, cp_size, cp_rank = int(seq_len), int(cp_size), int(cp_rank)
    chunk = seq_len // n
    starts = [cp_rank] if layout == "contiguous" else [cp_rank, 2 * cp_size - 1 - cp_rank]
    return torch.cat([torch.arange(s * chunk, (s + 1) * chunk, device=device) for s in starts])  # [S/W]


def shard(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int, layout: str = "zigzag") -> torch.Tensor:
    """This rank's slice of `x` along its sequence dimension `dim` (same index as `shard_positions`).

    Raises:
        PosencError: as `shard_positions` for `x.shape[dim]`, a non-tensor or 0-d `x`, a `dim` outside its rank.
    """
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        fail("x", "a torch.Tensor with a sequence dimension (rank >= 1)", x if isinstance(x, torch.Tensor) else type(x))
    dim = _dim(dim, x.ndim)
    index = shard_positions(x.shape[dim], cp_size, cp_rank, layout, device=x.device)  # [S/W]
    return x.index_select(dim, index)  # [..., S/W, ...]


def _dim(dim: Any, ndim: int) -> int:
    """`dim` as a non-negative index into `ndim` dimensions (negative counts from the end)."""
    return integer("dim", dim, min=-ndim, max=ndim - 1, what=f"an integer in [-{ndim}, {ndim}) (a dimension of the "
                   f"tensor, rank {ndim})") % ndim


def unshard_index(seq_len: int, cp_size: int, layout: str = "zigzag") -> torch.Tensor:
    """`[S]` int64 index that puts the rank-ordered concatenation of shards back in sequence order."""
    _check_grid(cp_size, 0, layout)
    order = torch.cat([shard_positions(seq_len, cp_size, r, layout) for r in range(cp_size)])  # [S]
    return torch.argsort(order)


def unshard(shards: Sequence[torch.Tensor], dim: int, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's shard, given in rank order.

    Raises:
        PosencError: an empty list, items that are not tensors of rank >= 1, shards of different shapes,
            dtypes or devices, or a `dim` outside their rank.
    """
    what = "a non-empty list of tensors of rank >= 1, one per rank in rank order"
    if not isinstance(shards, (list, tuple)) or not shards:
        fail("shards", what, shards)
    for i, part in enumerate(shards):
        if not isinstance(part, torch.Tensor) or part.ndim == 0:
            fail("shards", what, Raw(f"shards[{i}] = {part!r}"[:120]))
    first = shards[0]
    dim = _dim(dim, first.ndim)
    sizes = {s.shape[dim] if s.ndim == first.ndim else -1 for s in shards}
    if len(sizes) != 1 and -1 not in sizes:
        fail("shards", "shards of equal length along dim", Raw(f"lengths {sorted(sizes)}"))
    for i, part in enumerate(shards):  # one rank's shard of one tensor: the same shape, dtype and device
        if (part.shape, part.dtype, part.device) != (first.shape, first.dtype, first.device):
            fail("shards", f"shards like shards[0] (shape {tuple(first.shape)}, {first.dtype}, on {first.device})",
                 Raw(f"shards[{i}] of shape {tuple(part.shape)}, {part.dtype}, on {part.device}"))
    full = torch.cat(list(shards), dim=dim)  # [..., S, ...] in rank order
    return full.index_select(dim, unshard_index(full.shape[dim], len(shards), layout).to(full.device))


class VarlenShard(NamedTuple):
    """One rank's tokens of a packed batch (see `shard_varlen`).

    Fields:
        index: int64 `[n]` global token indices into the packed sequence.
        positions: int64 `[n]` position of each token within its document.
        documents: int64 `[n]` document number of each token.
        cu_seqlens: int64 `[docs + 1]` local cumulative document lengths (TransformerEngine's THD form).
    """

    index: torch.Tensor
    positions: torch.Tensor
    documents: torch.Tensor
    cu_seqlens: torch.Tensor


def shard_varlen(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, layout: str = "zigzag") -> VarlenShard:
    """This rank's tokens of packed documents, the layout applied inside every document.

    Args:
        cu_seqlens: `[docs + 1]` integer cumulative lengths starting at 0 (each length a multiple of 2W for
            zigzag, of W for contiguous; pad documents as TransformerEngine requires).
        cp_size, cp_rank, layout: as `shard_positions`.
    Returns:
        A `VarlenShard` (global index, position within the document, document number, local cu_seqlens).
    Raises:
        PosencError: non-integer or non-increasing `cu_seqlens`, or a document the layout cannot split.

        >>> s = shard_varlen(torch.tensor([0, 4, 12, 16]), 2, 0)
        >>> s.index.tolist(), s.positions.tolist()
        ([0, 3, 4, 5, 10, 11, 12, 15], [0, 3, 0, 1, 6, 7, 0, 3])
    """
    _check_grid(cp_size, cp_rank, layout)
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1
            or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool):
        fail("cu_seqlens", "a 1-D integer tensor [docs + 1] starting at 0", cu_seqlens)
    bounds = cu_seqlens.long().tolist()
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        fail("cu_seqlens", "non-decreasing cumulative lengths starting at 0", Raw(str(bounds)))
    index, positions, documents, local = [], [], [], [0]
    for doc, (start, end) in enumerate(zip(bounds, bounds[1:])):
        mine = shard_positions_of_document(end - start, cp_size, cp_rank, layout, doc)  # [n_doc]
        index.append(mine + start)
        positions.append(mine)
        documents.append(torch.full_like(mine, doc))
        local.append(local[-1] + mine.numel())
    empty = torch.zeros(0, dtype=torch.long)
    return VarlenShard(torch.cat(index or [empty]), torch.cat(positions or [empty]),
                       torch.cat(documents or [empty]), torch.tensor(local))


def shard_positions_of_document(length: int, cp_size: int, cp_rank: int, layout: str, doc: int) -> torch.Tensor:
    """`shard_positions` for one packed document, naming the document in the error."""
    _chunks(length, cp_size, layout, arg=f"cu_seqlens (document {doc} of length {length})")
    return shard_positions(length, cp_size, cp_rank, layout)
