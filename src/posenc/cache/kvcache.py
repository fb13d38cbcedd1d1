"""A KV cache that keeps the logical position of every slot, per batch row.

Slots of a row fill from 0 in the order tokens arrive; a row's positions are strictly increasing along
its slots (appends must continue past the last cached position), so slot order is position order and
the array index of a slot is never mistaken for its position. Empty slots have position -1.

Keys are stored `store="rotated"` (RoPE applied at write: decode reads them as they are) or
`"unrotated"` (rotated at read at the slot's current position: shifts and table switches cost nothing).
Each row remembers `table_len`, the sequence length whose RoPE table its keys belong to; length-dependent
scalings (dynamic NTK, LongRoPE) pick their frequencies from it, one row at a time, so a row never depends
on what else is in its batch (transformers takes the batch maximum; posenc does not).

The class holds the bookkeeping (positions, tokens, lengths, table_len) and one `KVStore` per layer
(`storage.py`: contiguous; `paged.py`: blocks with a block table per row, `block_size=`). What happens
when a row's table changes is `policy.py` (the `policy`: "recompute", "rerotate", "freeze", "refuse");
windows, sinks, rollback, beam reorder and moves are `edit.py`. Every edit works in place: a tensor a
caller holds (`positions`, `lengths`, a store's `read()` view) stays the cache's own; only `grow` and a
`reorder` to another batch size reallocate. Appending to a fixed-capacity cache (`reserve`, `write`, `read`
with a width) makes no host sync. A cache of absolute position embeddings (`absolute=True`) cannot
relabel slots: `move` and `keep_recent(shift=True)` refuse (only a re-run of the tokens could move them).

    >>> import torch, posenc
    >>> cache = KVCache(1, 1, 1, 4, capacity=8, rope=posenc.Rope(head_dim=4))
    >>> slots = cache.reserve(torch.tensor([[5, 6]]))      # two tokens at logical positions 5 and 6
    >>> cache.positions[0, :3].tolist(), cache.next_positions().tolist()
    ([5, 6, -1], [7])
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from . import edit, policy as policies
from .transaction import Journal, Transaction
from .checks import check_layout, check_new_positions, check_tokens, check_write
from .paged import BlockTable, PagedStore
from .storage import ContiguousStore, KVStore
from ..errors import boolean, choice, fail, integer, positions as check_positions
from ..rope import dispatch
from ..rope.rerotate import row_tables
from ..rope.spec import Rope

__all__ = ["KVCache", "STORES", "POLICIES"]

STORES = ("rotated", "unrotated")
POLICIES = policies.POLICIES
INITIAL_CAPACITY = 64  # slots per row of a growable cache (capacity=None) before its first growth


class KVCache:
    """Key/value storage (fixed capacity, or growing on demand) with the logical position of every slot, per row.

    Args:
        num_layers: layers (one store each).
        batch_size: rows b.
        num_kv_heads: key/value heads hk.
        head_dim: channels per key head d.
        capacity: slots per row, or None to grow on demand (doubling when an append needs more).
        rope: the RoPE the keys carry (None for caches of schemes that do not rotate keys).
        store: "rotated" (keys stored rotated) or "unrotated" (rotated on read).
        policy: what `retable` does when a row's table changes (see `posenc.cache.policy`).
        value_dim: channels per value head (default d).
        dtype, device: of the buffers (the model's dtype).
        absolute: the keys and values carry absolute position embeddings: slots cannot be moved.
        block_size: None (contiguous rows) or slots per block of paged storage (`PagedStore`): rows own
            block tables, `reorder` moves tables (forked rows share blocks, copied on write).
        make_store: None (`ContiguousStore`) or a callable with `ContiguousStore`'s signature making each
            layer's `KVStore` (e.g. `posenc.cache.quant.store.QuantStore`, which `QuantizedKVCache` passes).
    Attributes:
        positions `[b, capacity]` int64 (-1 = empty); tokens `[b, capacity]` token ids (-1 = unknown);
        lengths `[b]` filled slots; table_len `[b]` sequence length of the row's table (0 = never filled);
        stores: one `KVStore` per layer; k, v: per layer `[b, hk, capacity, d]` (each store's `read()`).
    Raises:
        PosencError: non-positive sizes or block size, an unknown store or policy, a rope whose head_dim is not d,
            a make_store with a block_size (paged storage makes its own stores).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int | None, *,
                 rope: Rope | None = None, store: str = "rotated", policy: str = "recompute",
                 value_dim: int | None = None, dtype: torch.dtype = torch.float32, device: Any = None,
                 absolute: bool = False, block_size: int | None = None,
                 make_store: Callable[..., KVStore] | None = None) -> None:
        self.growable = capacity is None  # grow on demand, doubling (amortised O(1) per token)
        capacity = INITIAL_CAPACITY if capacity is None else capacity
        sizes = dict(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     capacity=capacity, value_dim=head_dim if value_dim is None else value_dim)
        sizes = {arg: integer(arg, value, min=1) for arg, value in sizes.items()}
        num_layers, batch_size, num_kv_heads, head_dim, capacity, value_dim = sizes.values()
        block_size = check_layout(head_dim, block_size, rope, dtype, make_store)
        choice("store", store, STORES)
        choice("policy", policy, POLICIES)
        self.absolute = boolean("absolute", absolute)
        self.rope, self.store, self.policy = rope, store, policy
        self.num_kv_heads, self.head_dim, self.value_dim = num_kv_heads, head_dim, value_dim
        shape = (batch_size, num_kv_heads, capacity, head_dim, value_dim)
        if block_size is None:
            self.pages = None
            make = ContiguousStore if make_store is None else make_store
            self.stores: list[KVStore] = [make(*shape, dtype=dtype, device=device, layers=num_layers)
                                          for _ in range(num_layers)]
        else:
            self.pages = BlockTable(batch_size, capacity, block_size, device=device)
            self.stores = [PagedStore(self.pages, capacity, num_kv_heads, head_dim, value_dim, dtype=dtype,
                                      device=device, layers=num_layers) for _ in range(num_layers)]
        self.positions = torch.full((batch_size, capacity), -1, dtype=torch.long, device=device)
        self.tokens = torch.full((batch_size, capacity), -1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.table_len = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.high_water = 0  # host-side bound on lengths.max(), kept without a sync: reserve adds t, edits lower it
        self.dtype = dtype  # what reads return (the model's dtype)
        self.journal: Journal | None = None  # the undo log of the open `transaction()`, if any

    # ---------------------------------------------------------------- facts
    @property
    def rotates_at_write(self) -> bool:
        """Whether `write` stores keys rotated (store "rotated" with a rope): a caller may rotate them first."""
        return self.store == "rotated" and self.rope is not None

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.stores)

    @property
    def k(self) -> list[torch.Tensor]:
        """Per layer `[b, hk, capacity, d]` keys as stored (views of a contiguous store)."""
        return [store.read()[0] for store in self.stores]

    @property
    def v(self) -> list[torch.Tensor]:
        """Per layer `[b, hk, capacity, dv]` values as stored."""
        return [store.read()[1] for store in self.stores]

    @property
    def width(self) -> int:
        """Slots a read covers: the longest row's length (one host sync)."""
        return int(self.lengths.max()) if self.batch_size else 0

    @property
    def read_width(self) -> int:
        """Slots a read must cover, known on the host (no sync): at least `width`, equal to it unless some
        call padded every row at once or a reorder dropped the longest row."""
        return min(self.high_water, self.capacity)

    def next_positions(self) -> torch.Tensor:
        """`[b]` int64: one past each row's last cached position (0 for an empty row)."""
        return self.positions.max(dim=1).values.clamp(min=-1) + 1

    def valid(self) -> torch.Tensor:
        return self.positions >= 0  # [b, capacity] bool: filled slots

    def __repr__(self) -> str:
        paged = "" if self.pages is None else f", block_size={self.pages.block_size}"
        return (f"KVCache(layers={self.num_layers}, batch={self.batch_size}, capacity={self.capacity}{paged}, "
                f"store={self.store!r}, policy={self.policy!r}, lengths={self.lengths.tolist()})")

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def transaction(self) -> contextlib.AbstractContextManager["KVCache"]:
        """All or nothing: calls inside the block either all complete, or an exception leaves every tensor,
        statistic, block table and counter of the cache bit-identical to before the block (then it propagates).

        Costs a copy of the bookkeeping, of the entries each write overwrites and, once, of the stores if an
        edit touches them inside the block (`posenc.cache.transaction`). A nested block joins the outer one.
        Device-side checks on an accelerator (a quantized format's range) fail at the next synchronisation,
        after the block; under `torch.compile` the block is a plain one (a graph keeps no undo log).

            >>> import torch
            >>> cache = KVCache(1, 1, 1, 4, capacity=8)
            >>> try:
            ...     with cache.transaction():
            ...         slots = cache.reserve(torch.tensor([[0, 1]]))
            ...         cache.write(0, torch.ones(1, 1, 2, 4), torch.ones(1, 1, 3, 4), slots)  # v: 3 tokens
            ... except ValueError:
            ...     pass
            >>> cache.lengths.tolist(), cache.positions[0, :2].tolist()
            ([0], [-1, -1])
        """
        if self.journal is not None or torch.compiler.is_compiling():
            return contextlib.nullcontext(self)
        return Transaction(self)

    def _layer(self, layer: Any) -> int:
        return integer("layer", layer, min=0, max=self.num_layers - 1)

    # ---------------------------------------------------------------- writing
    def check_append(self, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Validate new tokens without changing anything (no host sync when they are valid); return the mask `[b, t]`.

        New positions of a row must be >= 0, strictly increasing, past the row's last cached position,
        and fit in the free slots (a growable cache grows instead). Masked tokens (padding) never enter.

        Args:
            positions: `[b, t]` integer logical positions.
            mask: `[b, t]` bool, False for padding (default: no padding).
        Raises:
            PosencError: naming `positions` or `mask`.
        """
        free = None if self.growable else self.capacity - self.lengths
        return check_new_positions(positions, mask, self.next_positions() - 1, free, capacity=self.capacity,
                                   lengths=self.lengths)

    def reserve(self, positions: torch.Tensor, mask: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Claim slots for new tokens and record their positions (and token ids, which "recompute" needs).

        No host sync for a fixed capacity; a growable cache reads the needed size on the host.

        Args:
            positions: `[b, t]` integer logical positions.
            mask: `[b, t]` bool, False for padding (no slot).
            tokens: `[b, t]` token ids, or None.
        Returns:
            `[b, t]` int64 slot of each token (-1 for padding), for `write`.
        Raises:
            PosencError: see `check_append`; tokens of another shape or a float dtype. Nothing changes then.
        """
        mask = self.check_append(positions, mask)
        positions = check_positions("positions", positions, allow_negative=True, check_values=False).long()
        check_tokens(tokens, positions.shape)
        if self.growable:
            need = int((self.lengths + mask.sum(dim=1)).max())  # host sync: growth needs the size
            if need > self.capacity:
                self.grow(max(need, 2 * self.capacity))
        slots = (self.lengths[:, None] + mask.long().cumsum(dim=1) - 1).masked_fill(~mask, -1)  # [b, t]
        if self.pages is not None:  # blocks written for the first time since a fork become private
            edit.own_slots(self, *self.write_index(slots))
        spill = torch.where(slots < 0, self.capacity, slots)  # [b, t]; padding -> a scratch column
        for held, new in ((self.positions, positions), (self.tokens, tokens)):
            if new is not None:
                wide = torch.nn.functional.pad(held, (0, 1))  # [b, capacity + 1]
                held.copy_(wide.scatter_(1, spill, new.to(held.device).long())[:, :-1])
        self.lengths += mask.sum(dim=1)
        self.high_water += positions.shape[1]
        return slots

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
              index: tuple[torch.Tensor, torch.Tensor] | None = None, *, rotated: bool = False) -> None:
        """Store one layer's new keys and values in their reserved slots (no host sync).

        Args:
            layer: layer index.
            k: `[b, hk, t, d]` keys, NOT rotated; rotated here when `store="rotated"` and the cache has a rope.
            v: `[b, hk, t, dv]` values.
            slots: `[b, t]` from `reserve`.
            cos, sin: `[b, t, r/2]` tables of the new positions (default: `row_tables` at `table_len`).
            index: `write_index(slots)`, computed once per forward and shared by the layers.
            rotated: k is already rotated with `cos`/`sin` (the decoder rotates q and k of a layer in one call).
        Raises:
            PosencError: k, v or slots of other shapes than this cache's rows and heads; slots not reserved
                (-1, or below each row's length). Nothing is written then.
        """
        layer = self._layer(layer)
        check_write(k, v, slots, (self.batch_size, self.num_kv_heads, self.head_dim, self.value_dim), self.lengths)
        if rotated and not self.rotates_at_write:
            fail("rotated", "False for a cache that stores keys unrotated (or has no rope)", rotated)
        if self.rotates_at_write and not rotated:
            if cos is None or sin is None:
                cos, sin = self.tables(self.positions.gather(1, slots.clamp(min=0)))
            k = dispatch.rotate(k, None, cos, sin, None, self.rope.pairing)[0]  # [b, hk, t, d]
        rows, flat = self.write_index(slots) if index is None else index  # [b * t]
        if self.journal is not None:
            self.journal.before_write(self.stores[layer], rows, flat)
        self.stores[layer].write(rows, flat, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))

    @staticmethod
    def write_index(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rows [b * t], slots [b * t])`: the row and slot of every entry of `slots [b, t]` (no host sync)."""
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None].expand(slots.shape)  # [b, t]
        return rows.flatten(), slots.flatten()

    # ---------------------------------------------------------------- reading
    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`row_tables` of this cache's rope for `positions [b, t]`, each row at its `table_len`."""
        if self.rope is None:
            fail("rope", "a posenc.Rope (this cache was built without one)", None)
        positions = check_positions("positions", positions, shapes=[(self.batch_size, "t")], allow_negative=True)
        return row_tables(self.rope, positions, self.table_len)

    def read(self, layer: int, key_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rotated at their slot positions) and values of the first `width` slots.

        Args:
            layer: layer index.
            key_tables: for unrotated storage, precomputed `tables(positions[:, :width])` (one per step).
            width: slots to read (default `self.width`, one host sync; `capacity` makes none).
        Returns:
            `(k [b, hk, width, d], v [b, hk, width, dv])`; pair with `positions[:, :width]` and `valid()`.
        """
        layer = self._layer(layer)
        w = self.width if width is None else width
        k, v = self.stores[layer].read(w)  # [b, hk, w, d]
        if self.store == "unrotated" and self.rope is not None:
            cos, sin = key_tables if key_tables is not None else self.tables(self.positions[:, :w])
            k = dispatch.rotate(k, None, cos, sin, None, self.rope.pairing)[0]  # [b, hk, w, d]
        return k, v

    def update(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cos: Any = None,
               sin: Any = None, index: Any = None, rotated: bool = False,
               key_tables: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """gpt-fast's `update`: `write` the new entries, then `read` the first `read_width` slots (no host sync).

        Returns: `(k [b, hk, w, d], v [b, hk, w, dv])`, `w = read_width`; pair with `positions[:, :w]`.
        """
        self.write(layer, k, v, slots, cos, sin, index, rotated=rotated)
        return self.read(layer, key_tables, self.read_width)

    # ---------------------------------------------------------------- tables and policies (policy.py)
    def table_changes(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """`[b]` bool: filled rows whose table at `seq_lens [b]` differs from the one their keys use."""
        return policies.table_changes(self, seq_lens)

    def retable(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Move each row to the table of `seq_lens [b]` under the cache's policy; `[b]` bool rows to re-run
        ("recompute"). See `posenc.cache.policy.retable`."""
        return policies.retable(self, seq_lens)

    # ---------------------------------------------------------------- edits (edit.py)
    def grow(self, capacity: int) -> None:
        """Enlarge every row to `capacity` slots (reallocates: tensors taken before go stale)."""
        edit.grow(self, capacity)

    def clear(self, rows: torch.Tensor | None = None) -> None:
        """Empty the given rows (`[b]` bool; default all)."""
        edit.clear(self, rows)

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the filled slots where `keep [b, capacity]` is True, compacted in order; drop the rest."""
        edit.keep(self, keep)

    def rollback(self, n: int | torch.Tensor) -> None:
        """Drop the last `n` tokens of each row (`n` int or `[b]`), e.g. rejected speculative tokens."""
        edit.rollback(self, n)

    def reorder(self, index: torch.Tensor) -> None:
        """Rows become `old_rows[index]` (beam search; repeats fork rows). See `posenc.cache.edit.reorder`."""
        edit.reorder(self, index)

    def keep_recent(self, window: int, sinks: int = 0, *, shift: bool = False) -> None:
        """Keep the first `sinks` and last `window` tokens of each row (StreamingLLM); `shift` relabels them."""
        edit.keep_recent(self, window, sinks, shift=shift)

    def move(self, new_positions: torch.Tensor) -> None:
        """Give filled slots new positions `[b, capacity]`, re-rotating rotated keys."""
        edit.move(self, new_positions)
