"""What a cache does when a row's RoPE table changes (length-dependent scalings: dynamic NTK, LongRoPE).

- "recompute": report the row; the model re-runs its cached tokens under the new table (exact).
- "rerotate": turn every layer's cached keys from the old table to the new one (rotated storage), or
  just switch the table rotated on read (unrotated storage).
- "freeze": keep the table chosen when the row was first filled.
- "refuse": raise PosencError, changing nothing.
A scaling whose frequencies do not depend on the length never changes a table: `retable` then only
records the lengths, with no host sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import fail, integer_tensor
from ..rope.apply import apply_rope
from ..rope.rerotate import rerotation_tables, stored_pairing
from .transaction import before_edit

if TYPE_CHECKING:
    from .kvcache import KVCache

__all__ = ["POLICIES", "table_changes", "retable", "rerotate_rows"]

POLICIES = ("recompute", "rerotate", "freeze", "refuse")


def _length_dependent(cache: "KVCache") -> bool:
    return cache.rope is not None and cache.rope.scaling.depends_on_length


def table_changes(cache: "KVCache", seq_lens: torch.Tensor) -> torch.Tensor:
    """`[b]` bool: filled rows whose table at `seq_lens [b]` differs from the one their keys use."""
    changed = torch.zeros(cache.batch_size, dtype=torch.bool, device=cache.lengths.device)
    if not _length_dependent(cache):
        return changed
    for row in (cache.lengths > 0).nonzero().flatten().tolist():
        old = cache.rope.inv_freq(int(cache.table_len[row]))
        new = cache.rope.inv_freq(int(seq_lens[row]))
        changed[row] = not (torch.equal(old[0], new[0]) and old[1] == new[1])
    return changed


def retable(cache: "KVCache", seq_lens: torch.Tensor) -> torch.Tensor:
    """Move each row of `cache` to the table of `seq_lens [b]` under the cache's policy.

    Returns:
        `[b]` bool: rows the caller must re-run from their cached tokens ("recompute"; their cached
        entries are left as they are, the caller clears them). Empty rows simply adopt the new length.
    Raises:
        PosencError: policy "refuse" and a filled row whose frequencies would change (nothing is modified).
    """
    seq_lens = integer_tensor("seq_lens", seq_lens, ndim=(1,)).to(cache.table_len)
    if seq_lens.shape[0] != cache.batch_size:
        fail("seq_lens", f"{cache.batch_size} lengths (one per row)", seq_lens)
    if not _length_dependent(cache):  # the table is the same at every length: record it, no host sync
        adopt = cache.lengths == 0 if cache.policy == "freeze" else torch.ones_like(cache.lengths, dtype=torch.bool)
        cache.table_len.copy_(torch.where(adopt, seq_lens, cache.table_len))
        return torch.zeros_like(adopt)
    changed = table_changes(cache, seq_lens)
    if cache.policy == "refuse" and bool(changed.any()):
        row = int(changed.nonzero()[0])
        fail("policy", f"a table that stays the same (row {row} was filled at length "
             f"{int(cache.table_len[row])}; policy 'refuse')", f"length {int(seq_lens[row])}")
    if cache.policy == "freeze":
        adopt = cache.lengths == 0
    elif cache.policy == "rerotate":
        if cache.store == "rotated" and bool(changed.any()):
            rerotate_rows(cache, changed, cache.positions, seq_lens)
        adopt = torch.ones_like(changed)
    else:  # recompute, or refuse with nothing changing
        adopt = ~changed if cache.policy == "recompute" else torch.ones_like(changed)
    cache.table_len.copy_(torch.where(adopt, seq_lens, cache.table_len))
    return changed if cache.policy == "recompute" else torch.zeros_like(changed)


def rerotate_rows(cache: "KVCache", rows: torch.Tensor, new_positions: torch.Tensor, new_lens: torch.Tensor) -> None:
    """Rotated storage: turn the keys of `rows [b]` (bool) from (positions, table_len) to (new_positions, new_lens).

    Reads each store's keys and writes them back at the same slots (`KVStore.write` with `v=None`).
    """
    w = cache.width
    index = rows.nonzero().flatten()  # [n] rows to turn
    if index.numel() == 0 or w == 0:
        return
    before_edit(cache)
    old_p, new_p = cache.positions[index, :w], new_positions[index, :w]  # [n, w]
    cos, sin = rerotation_tables(cache.rope, old_p, new_p, cache.table_len[index], new_lens[index])  # [n, w, r/2]
    pairing = stored_pairing(cache.rope)
    filled = old_p >= 0  # [n, w]: empty slots stay as they are
    slot = torch.arange(w, device=index.device).expand(index.shape[0], w)  # [n, w]
    at_rows = index[:, None].expand(-1, w).flatten()  # [n * w]
    at_slots = slot.masked_fill(~filled, -1).flatten()
    if cache.pages is not None:
        from .edit import own_slots

        own_slots(cache, at_rows, at_slots)
    for store in cache.stores:
        keys = store.read(w)[0][index]  # [n, hk, w, d]
        turned = apply_rope(keys, cos.to(keys.device), sin.to(keys.device), pairing=pairing)  # [n, hk, w, d]
        store.write(at_rows, at_slots, turned.transpose(1, 2).flatten(0, 1).to(keys.dtype), None)
