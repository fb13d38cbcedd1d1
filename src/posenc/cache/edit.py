"""Editing a `KVCache`: clear, keep (compaction), rollback, reorder, windows with sinks, moves.

Every edit validates first and then works in place (`copy_` on the bookkeeping tensors, `copy_slots`
on the stores), so nothing a caller holds is rebound and a refused call changes nothing. On paged
storage the blocks an edit writes to are made private first (`own_slots`, copy-on-write), and `reorder`
moves block tables instead of keys and values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import Raw, boolean, fail, integer, integer_tensor, positions as check_positions
from .policy import rerotate_rows
from .transaction import before_edit

if TYPE_CHECKING:
    from .kvcache import KVCache

__all__ = ["grow", "own_slots", "clear", "keep", "rollback", "reorder", "keep_recent", "move"]


def grow(cache: "KVCache", capacity: int) -> None:
    """Enlarge every row to `capacity` slots (at least the current one); filled slots are unchanged.

    It reallocates (as only a `reorder` to another batch size also does): tensors taken before go stale.
    """
    capacity = integer("capacity", capacity, min=cache.capacity,
                       what=f"an integer >= the current capacity {cache.capacity}")
    extra = capacity - cache.capacity
    if extra == 0:
        return
    before_edit(cache)
    if cache.pages is not None:
        cache.pages.grow(capacity)
    for store in cache.stores:
        store.grow(capacity)
    pad = torch.nn.functional.pad
    cache.positions = pad(cache.positions, (0, extra), value=-1)  # [b, capacity]
    cache.tokens = pad(cache.tokens, (0, extra), value=-1)


def own_slots(cache: "KVCache", rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Paged storage: give each row a private copy of the shared blocks holding `(rows [n], slots [n])` (-1: none)."""
    src, dst = cache.pages.own(rows, slots)  # [m] blocks to copy (scratch -> scratch where nothing to do)
    for store in cache.stores:
        if cache.journal is not None:
            cache.journal.record(store.save_blocks(dst))
        store.copy_blocks(src, dst)


def _rewrite(cache: "KVCache", src_slot: torch.Tensor, dst: torch.Tensor) -> None:
    """Per row, slot `s` of every store takes slot `src_slot[r, s]` (-1: zeros) where `dst [b, cap]` is True."""
    before_edit(cache)
    b, cap = src_slot.shape
    rows = torch.arange(b, device=src_slot.device)[:, None].expand(b, cap)  # [b, cap]
    slot = torch.arange(cap, device=src_slot.device).expand(b, cap)
    at_rows, at_slots = rows.flatten(), slot.masked_fill(~dst, -1).flatten()  # [b * cap]; -1 is dropped
    if cache.pages is not None:
        own_slots(cache, at_rows, at_slots)
    for store in cache.stores:
        store.copy_slots(at_rows, src_slot.flatten(), at_rows, at_slots)


def clear(cache: "KVCache", rows: torch.Tensor | None = None) -> None:
    """Empty the given rows (`[b]` bool; default all)."""
    if rows is None:
        rows = torch.ones_like(cache.lengths, dtype=torch.bool)
    elif not isinstance(rows, torch.Tensor) or rows.dtype != torch.bool or rows.shape != cache.lengths.shape:
        fail("rows", f"None or a bool tensor of shape [{cache.batch_size}]", rows)
    rows = rows.to(cache.lengths.device)
    gone = rows[:, None] & cache.valid()  # [b, cap]
    _rewrite(cache, torch.full_like(cache.positions, -1), gone)
    cache.positions.masked_fill_(rows[:, None], -1)
    cache.tokens.masked_fill_(rows[:, None], -1)
    cache.lengths.masked_fill_(rows, 0)
    cache.high_water = cache.width
    cache.table_len.masked_fill_(rows, 0)


def keep(cache: "KVCache", keep: torch.Tensor) -> None:
    """Keep the filled slots where `keep [b, capacity]` is True, compacted in order; drop (zero) the rest."""
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != cache.positions.shape:
        fail("keep", f"a bool tensor of shape {tuple(cache.positions.shape)}", keep)
    keep = keep.to(cache.positions.device) & cache.valid()  # [b, cap]
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # [b, cap]: kept slots first, in order
    kept = keep.gather(1, order)  # [b, cap]: slot s is filled after the edit
    slot = torch.arange(cache.capacity, device=order.device).expand_as(order)
    src = order.masked_fill(~kept, -1)  # [b, cap]: where slot s reads from (-1 = zeros)
    changed = (src != slot) & (kept | cache.valid())  # [b, cap]: slots whose content changes
    _rewrite(cache, src, changed)
    cache.positions.copy_(cache.positions.gather(1, order).masked_fill(~kept, -1))
    cache.tokens.copy_(cache.tokens.gather(1, order).masked_fill(~kept, -1))
    cache.lengths.copy_(keep.sum(dim=1))
    cache.high_water = cache.width  # an edit may sync (appends do not): reads narrow to the longest row again


def rollback(cache: "KVCache", n: int | torch.Tensor) -> None:
    """Drop the last `n` tokens of each row (`n` int or `[b]`), e.g. rejected speculative tokens."""
    what = f"an integer (or [b={cache.batch_size}] integers) in [0, lengths={cache.lengths.tolist()}]"
    if isinstance(n, torch.Tensor):
        n = integer_tensor("n", n, ndim=(0, 1), what=what).to(cache.lengths.device)
        if n.ndim == 1 and n.shape[0] != cache.batch_size:
            fail("n", what, n)
    else:
        n = torch.tensor(integer("n", n, what=what), device=cache.lengths.device)
    if bool(((n < 0) | (n > cache.lengths)).any()):
        fail("n", what, Raw(str(n.tolist())))
    slot = torch.arange(cache.capacity, device=cache.lengths.device)
    keep(cache, slot[None, :] < (cache.lengths - n)[:, None])


def reorder(cache: "KVCache", index: torch.Tensor) -> None:
    """Rows become `old_rows[index]` (beam search; `index` may repeat rows: forks). Every row keeps its positions.

    Contiguous storage copies the rows in place; paged storage moves block tables only (shared blocks
    gain references and are copied when a row first writes to them).

    Raises:
        PosencError: naming `index`: not a 1-D integer tensor, empty (a cache keeps at least one row), or a
            row outside [0, batch_size). Nothing changes then.
    """
    what = f"a non-empty 1-D integer tensor of rows in [0, {cache.batch_size})"
    index = integer_tensor("index", index, ndim=(1,), what=what)
    if index.numel() == 0 or bool(((index < 0) | (index >= cache.batch_size)).any()):
        fail("index", what, Raw(str(index.tolist())))
    index = index.to(cache.lengths.device)
    before_edit(cache)
    same = index.shape[0] == cache.batch_size  # in place; another batch size reallocates (as grow does)
    for name in ("positions", "tokens", "lengths", "table_len"):
        held = getattr(cache, name)
        if same:
            held.copy_(held[index])
        else:
            setattr(cache, name, held[index])
    if cache.pages is not None:
        cache.pages.reorder(index)
    for store in cache.stores:
        store.reorder(index)


def keep_recent(cache: "KVCache", window: int, sinks: int = 0, *, shift: bool = False) -> None:
    """Sliding window with attention sinks (StreamingLLM): keep the first `sinks` and last `window` tokens.

    With `shift=True` the kept tokens move to contiguous positions starting at the row's first kept
    position; rotated keys are rotated by the position difference (no recomputation).

    Raises:
        PosencError: a window < 1 or sinks < 0; `shift=True` on a cache of absolute position embeddings.
    """
    window = integer("window", window, min=1, what="an integer >= 1")
    sinks = integer("sinks", sinks, min=0)
    if boolean("shift", shift) and cache.absolute:
        fail("shift", "False for a cache of absolute position embeddings (its keys and values carry their "
             "positions; re-run the kept tokens to move them)", True)
    slot = torch.arange(cache.capacity, device=cache.lengths.device)[None, :]  # [1, cap]
    keep(cache, (slot < sinks) | (slot >= cache.lengths[:, None] - window))
    if shift:
        first = cache.positions[:, :1].clamp(min=0)  # [b, 1]
        move(cache, torch.where(cache.valid(), first + slot, -1))


def move(cache: "KVCache", new_positions: torch.Tensor) -> None:
    """Give filled slots new positions (`[b, capacity]`, strictly increasing per row), re-rotating keys.

    Rotated storage turns each key from its old position to its new one with the row's table
    (`rerotation_tables`); unrotated storage and bias schemes just read the new positions.

    Raises:
        PosencError: positions of another shape, negative or not increasing on filled slots; a cache of
            absolute position embeddings (`absolute=True`) given positions that differ from its own.
    """
    new_positions = check_positions("new_positions", new_positions, shapes=[tuple(cache.positions.shape)],
                                    allow_negative=True, device=cache.positions.device)
    valid = cache.valid()
    new_positions = torch.where(valid, new_positions.long(), -1)
    step = new_positions[:, 1:] - new_positions[:, :-1]
    if bool((valid & (new_positions < 0)).any()) or bool((valid[:, 1:] & (step <= 0)).any()):
        fail("new_positions", "positions >= 0, strictly increasing along each row's filled slots", new_positions)
    if cache.absolute and not torch.equal(new_positions, cache.positions):
        fail("new_positions", "the current positions: this cache's keys and values carry absolute position "
             "embeddings, which cannot be moved (re-run the tokens at their new positions)", new_positions)
    if cache.rotates_at_write:
        rerotate_rows(cache, cache.lengths > 0, new_positions, cache.table_len)
    cache.positions.copy_(new_positions)
