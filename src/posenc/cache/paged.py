"""Paged storage: fixed-size blocks, a block table per row, shared blocks copied on write (vLLM's layout).

Slot `s` of row `r` lives at offset `s % block_size` of block `table[r, s // block_size]`. Every layer
has its own pool of blocks (`PagedStore`); all layers share one `BlockTable` (the table, and a
reference count per block as a tensor). `reorder(index)` only copies table rows, so rows forked from one
prompt (beam search, parallel samples) share its blocks; the first write into a shared block gives the
writing row a private copy (`own`), taken from the free list (blocks whose count is 0).

A pool holds `batch_size * ceil(capacity / block_size)` blocks plus a scratch block that takes padding.
That is always enough: a row refers to that many blocks, and when every sharer of a block writes to it at
once, one of them keeps the original, so the blocks in use never outnumber the table's entries.
Allocation, copy-on-write and reads are fixed-shape tensor work: no host sync.

    >>> import torch
    >>> table = BlockTable(batch_size=2, capacity=4, block_size=2)
    >>> table.table.tolist(), table.refs.tolist()
    ([[0, 1], [2, 3]], [1, 1, 1, 1])
    >>> table.reorder(torch.tensor([0, 0]))          # row 1 forks row 0: blocks 0 and 1 shared, 2 and 3 free
    >>> table.table.tolist(), table.refs.tolist()
    ([[0, 1], [0, 1]], [2, 2, 0, 0])
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import assert_values
from .storage import allocate, check_copy

__all__ = ["BlockTable", "PagedStore"]


class BlockTable:
    """Block tables `[b, blocks_per_row]` and per-block reference counts `[num_blocks]` (int64 tensors).

    Args:
        batch_size, capacity: rows and slots per row.
        block_size: slots per block (validated by `KVCache`).
        device: of the tables.
    """

    def __init__(self, batch_size: int, capacity: int, block_size: int, device: Any = None) -> None:
        self.block_size = block_size
        per_row = -(-capacity // block_size)
        self.table = torch.arange(batch_size * per_row, device=device).view(batch_size, per_row)  # [b, nb]
        self.refs = torch.ones(batch_size * per_row, dtype=torch.long, device=device)  # [num_blocks]

    @property
    def num_blocks(self) -> int:
        """Blocks in each pool, the scratch block (index `num_blocks`) not counted."""
        return self.refs.shape[0]

    def locate(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`[n]` flat pool index `block * block_size + offset` of `(rows [n], slots [n])`; slot -1 -> scratch."""
        blocks = self.table[rows, slots.clamp(min=0) // self.block_size]  # [n]
        flat = blocks * self.block_size + slots.clamp(min=0) % self.block_size
        return torch.where(slots < 0, self.num_blocks * self.block_size, flat)

    def reorder(self, index: torch.Tensor) -> None:
        """Rows take the tables of `index [b']` (repeats share blocks); counts follow, unreferenced blocks free.

        More rows than blocks per pool (b' > b) add free blocks at the end (the pools follow in `PagedStore.reorder`).
        """
        if index.shape[0] == self.table.shape[0]:
            self.table.copy_(self.table[index])
        else:
            self.table = self.table[index]  # [b', nb]
        blocks = max(self.num_blocks, self.table.numel())
        refs = torch.zeros(blocks, dtype=torch.long, device=self.refs.device)
        refs.scatter_add_(0, self.table.flatten(), torch.ones_like(self.table.flatten()))
        if blocks == self.num_blocks:
            self.refs.copy_(refs)
        else:
            self.refs = refs

    def own(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the blocks about to be written at `(rows [n], slots [n])` private to their rows (slot -1: none).

        Returns:
            `(src [n], dst [n])` blocks each pool copies `dst <- src` (the scratch block where nothing moves).
        """
        n, per_row, scratch = rows.shape[0], self.table.shape[1], self.num_blocks
        i = torch.arange(n, device=rows.device)
        entry = torch.where(slots < 0, self.table.numel(), rows * per_row + slots.clamp(min=0) // self.block_size)
        first = torch.full((self.table.numel() + 1,), n, device=rows.device).scatter_reduce_(
            0, entry, i, reduce="amin")  # [entries + 1]: the first write of each table entry
        lead = (first[entry] == i) & (slots >= 0)  # [n]: one per touched entry
        blocks = torch.where(lead, self.table.flatten()[entry.clamp(max=self.table.numel() - 1)], scratch)
        touched = torch.zeros(scratch + 1, dtype=torch.long, device=rows.device).scatter_add_(
            0, blocks, lead.long())  # [num_blocks + 1]: entries of each block written now
        keeper = torch.full((scratch + 1,), n, device=rows.device).scatter_reduce_(0, blocks, i, reduce="amin")
        refs = torch.cat((self.refs, self.refs.new_ones(1)))  # [num_blocks + 1]
        all_write = touched[blocks] == refs[blocks]  # every sharer writes now: the first keeps the block
        copy = lead & (refs[blocks] > 1) & ~(all_write & (keeper[blocks] == i))  # [n]
        rank = copy.long().cumsum(0) - 1  # [n]
        free = torch.argsort((self.refs > 0).to(torch.int8), stable=True)  # [num_blocks]: free blocks first
        assert_values("block_size", copy.sum() <= (self.refs == 0).sum(), "enough free blocks (a paged-cache bug)",
                      lambda: int(copy.sum()))
        new = torch.where(copy, free[rank.clamp(min=0, max=scratch - 1)], scratch)  # [n]
        src = torch.where(copy, blocks, scratch)
        self.refs.scatter_add_(0, src.clamp(max=scratch - 1), -copy.long())
        self.refs.scatter_add_(0, new.clamp(max=scratch - 1), copy.long())
        flat = torch.cat((self.table.flatten(), self.table.new_zeros(1)))  # [entries + 1]: last = dump
        flat.scatter_(0, torch.where(copy, entry, self.table.numel()), new)
        self.table.copy_(flat[:-1].view_as(self.table))
        return src, new

    def grow(self, capacity: int) -> None:
        """More blocks per row for `capacity` slots: fresh blocks at the end of the pools (host-side sizes)."""
        b, per_row = self.table.shape
        more = -(-capacity // self.block_size) - per_row
        if more <= 0:
            return
        fresh = self.num_blocks + torch.arange(b * more, device=self.table.device).view(b, more)  # [b, more]
        self.table = torch.cat((self.table, fresh), dim=1)  # [b, nb + more]
        self.refs = torch.cat((self.refs, torch.ones(b * more, dtype=torch.long, device=self.refs.device)))


class PagedStore:
    """One layer's block pools `k [num_blocks + 1, block_size, hk, d]`, `v [..., dv]` over a shared `BlockTable`.

    Implements `KVStore` (see `storage.py`) plus `copy_blocks(src, dst)` for copy-on-write. `read(width)`
    gathers the blocks of each row's first `width` slots into `[b, hk, width, d]` (a fresh tensor, not a view).
    """

    def __init__(self, pages: BlockTable, capacity: int, num_kv_heads: int, head_dim: int, value_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: Any = None, layers: int = 1) -> None:
        self.pages, self.capacity = pages, capacity
        self._k, self._v = self._pools(pages.num_blocks + 1, num_kv_heads, head_dim, value_dim, dtype, device, layers)

    def _pools(self, blocks: int, hk: int, d: int, dv: int, dtype: torch.dtype, device: Any,
               layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.pages.block_size
        need = layers * blocks * bs * hk * (d + dv) * torch.empty((), dtype=dtype).element_size()
        return (allocate((blocks, bs, hk, d), dtype, device, "capacity", self.capacity, need),
                allocate((blocks, bs, hk, dv), dtype, device, "capacity", self.capacity, need))

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    @property
    def pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block pools themselves, `k [num_blocks + 1, block_size, hk, d]` and `v` (last block: scratch)."""
        return self._k, self._v

    def read(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.capacity if width is None else width
        table = self.pages.table[:, :-(-w // self.pages.block_size)]  # [b, blocks covering w slots]
        out = []
        for pool in (self._k, self._v):
            rows = pool[table]  # [b, nb, bs, hk, d]
            out.append(rows.flatten(1, 2)[:, :w].transpose(1, 2))  # [b, hk, w, d]
        return out[0], out[1]

    def write(self, rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        at = (self.pages.locate(rows, slots),)  # [n] flat pool slots
        self._k.flatten(0, 1).index_put_(at, k.to(self._k.dtype))  # [blocks * bs, hk, d] <- [n, hk, d]
        if v is not None:
            self._v.flatten(0, 1).index_put_(at, v.to(self._v.dtype))

    def save(self, rows: torch.Tensor, slots: torch.Tensor) -> Callable[[], None]:
        """`KVStore.save`: the pool entries a write to `(rows, slots)` would overwrite, under today's table."""
        return self._save_at(self.pages.locate(rows, slots), 1)

    def save_blocks(self, blocks: torch.Tensor) -> Callable[[], None]:
        """Like `save`, for whole blocks `[m]` (what `copy_blocks` into them would overwrite)."""
        return self._save_at(blocks, 0)

    def _save_at(self, at: torch.Tensor, dims: int) -> Callable[[], None]:
        held = [(pool, pool.flatten(0, dims)[at]) for pool in (self._k, self._v)]  # copies

        def undo() -> None:
            for pool, old in held:
                pool.flatten(0, dims).index_put_((at,), old)

        return undo

    def copy_slots(self, src_rows: torch.Tensor, src_slots: torch.Tensor, dst_rows: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
        check_copy(src_rows, src_slots, dst_rows, dst_slots, self.pages.table.shape[0], self.capacity)
        clear = (src_slots < 0)[:, None, None]  # [n, 1, 1]
        src, dst = self.pages.locate(src_rows, src_slots), self.pages.locate(dst_rows, dst_slots)
        for pool in (self._k, self._v):
            flat = pool.flatten(0, 1)  # [blocks * bs, hk, d]
            flat.index_put_((dst,), flat[src].masked_fill(clear, 0))  # sources read before any write

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block `dst[i]` becomes a copy of block `src[i]` (copy-on-write; scratch -> scratch is a no-op)."""
        for pool in (self._k, self._v):
            pool.index_put_((dst,), pool[src])

    def reorder(self, index: torch.Tensor) -> None:
        """The shared `BlockTable` moved already; pools only grow if it added blocks."""
        if self._k.shape[0] != self.pages.num_blocks + 1:
            self.grow(self.capacity)

    def grow(self, capacity: int) -> None:
        """Pools grow to the table's blocks (call after `BlockTable.grow`); old blocks keep their index."""
        old = self._k.shape[0] - 1
        self.capacity = capacity
        k, v = self._pools(self.pages.num_blocks + 1, self._k.shape[2], self._k.shape[3], self._v.shape[3],
                           self._k.dtype, self._k.device, 1)
        k[:old], v[:old] = self._k[:old], self._v[:old]
        self._k, self._v = k, v
