"""A KV cache that keeps the logical position of every slot, per batch row.

Slots of a row fill from 0 in the order tokens arrive; a row's positions are strictly increasing along
its slots (appends must continue past the last cached position), so slot order is position order and
the array index of a slot is never mistaken for its position. Empty slots have position -1.

Keys are stored `store="rotated"` (RoPE applied at write: decode reads them as they are) or
`"unrotated"` (rotated at read at the slot's current position: shifts and table switches cost nothing).
Each row remembers `table_len`, the sequence length whose RoPE table its keys belong to; length-dependent
scalings (dynamic NTK, LongRoPE) pick their frequencies from it, one row at a time, so a row never depends
on what else is in its batch (transformers takes the batch maximum; posenc does not).

When a row's table would change (`retable`), the cache applies its `policy`:
- "recompute": report the row; the model re-runs its cached tokens under the new table (exact).
- "rerotate": turn every layer's cached keys from the old table to the new one (rotated storage), or
  just switch the table rotated on read (unrotated storage).
- "freeze": keep the table chosen when the row was first filled.
- "refuse": raise PosencError.

A cache of absolute position embeddings (`absolute=True`: the decoder added them to the hidden states, so
every cached key and value carries its position) cannot relabel slots: `move` and `keep_recent(shift=True)`
refuse, since only a re-run of the tokens could move them.

    >>> import torch, posenc
    >>> cache = KVCache(1, 1, 1, 4, capacity=8, rope=posenc.Rope(head_dim=4))
    >>> slots = cache.reserve(torch.tensor([[5, 6]]))      # two tokens at logical positions 5 and 6
    >>> cache.positions[0, :3].tolist(), cache.next_positions().tolist()
    ([5, 6, -1], [7])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .errors import (Raw, boolean, check_float_tensor, choice, fail, integer, integer_tensor,
                     positions as check_positions)
from .rope import route
from .rope.apply import apply_rope
from .rope.rerotate import rerotation_tables, row_tables, stored_pairing
from .rope.spec import Rope

__all__ = ["KVCache", "STORES", "POLICIES"]

STORES = ("rotated", "unrotated")
POLICIES = ("recompute", "rerotate", "freeze", "refuse")
INITIAL_CAPACITY = 64  # slots per row of a growable cache (capacity=None) before its first growth


def _allocate(layers: int, shape_k: tuple[int, ...], shape_v: tuple[int, ...], dtype: torch.dtype,
              device: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed k and v buffers per layer; a capacity no element count or memory holds is refused by name."""
    numel = max(math.prod(shape_k), math.prod(shape_v))
    need = layers * (math.prod(shape_k) + math.prod(shape_v)) * torch.empty((), dtype=dtype).element_size()
    arg, value = ("batch_size", shape_k[0]) if shape_k[0] > shape_k[2] else ("capacity", shape_k[2])  # the culprit
    if numel >= 2**63:  # torch's "Storage size calculation overflowed"
        fail(arg, "a size whose [b, hk, capacity, d] buffers have < 2**63 elements", value)
    try:
        return ([torch.zeros(shape_k, dtype=dtype, device=device) for _ in range(layers)],
                [torch.zeros(shape_v, dtype=dtype, device=device) for _ in range(layers)])
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
        fail(arg, f"a cache that fits in memory ({need / 2**30:.3g} GiB of keys and values asked)",
             Raw(f"{value} ({type(err).__name__})"))


class KVCache:
    """Key/value buffers (fixed capacity, or growing on demand) with the logical position of every slot, per row.

    Args:
        num_layers: layers (one k and one v buffer each).
        batch_size: rows b.
        num_kv_heads: key/value heads hk.
        head_dim: channels per key head d.
        capacity: slots per row, or None to grow on demand (doubling when an append needs more).
        rope: the RoPE the keys carry (None for caches of schemes that do not rotate keys).
        store: "rotated" (keys stored rotated) or "unrotated" (rotated on read).
        policy: what `retable` does when a row's table changes (see the module docstring).
        value_dim: channels per value head (default d).
        dtype, device: of the buffers (the model's dtype).
        absolute: the keys and values carry absolute position embeddings (Sinusoidal, LearnedPositions
            added to the hidden states): slots cannot be moved to other positions.
    Attributes:
        k, v: per layer `[b, hk, capacity, d]`; positions `[b, capacity]` int64 (-1 = empty);
        tokens `[b, capacity]` int64 token ids (-1 = unknown); lengths `[b]` filled slots;
        table_len `[b]` sequence length of the table the row's keys use (0 = row never filled).
    Raises:
        PosencError: non-positive sizes, an unknown store or policy, a rope whose head_dim is not d.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int | None, *,
                 rope: Rope | None = None, store: str = "rotated", policy: str = "recompute",
                 value_dim: int | None = None, dtype: torch.dtype = torch.float32, device: Any = None,
                 absolute: bool = False) -> None:
        self.growable = capacity is None  # grow on demand, doubling (amortised O(1) per token)
        capacity = INITIAL_CAPACITY if capacity is None else capacity
        sizes = dict(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     capacity=capacity, value_dim=head_dim if value_dim is None else value_dim)
        sizes = {arg: integer(arg, value, min=1) for arg, value in sizes.items()}
        num_layers, batch_size, num_kv_heads, head_dim, capacity = (sizes[a] for a in list(sizes)[:5])
        choice("store", store, STORES)
        choice("policy", policy, POLICIES)
        self.absolute = boolean("absolute", absolute)
        if rope is not None and (not isinstance(rope, Rope) or rope.head_dim != head_dim):
            fail("rope", f"None or a posenc.Rope with head_dim={head_dim}", rope)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            fail("dtype", "a floating-point torch.dtype", dtype)
        self.rope, self.store, self.policy = rope, store, policy
        shape_k = (batch_size, num_kv_heads, capacity, head_dim)
        shape_v = (batch_size, num_kv_heads, capacity, sizes["value_dim"])
        self.k, self.v = _allocate(num_layers, shape_k, shape_v, dtype, device)
        self.positions = torch.full((batch_size, capacity), -1, dtype=torch.long, device=device)
        self.tokens = torch.full((batch_size, capacity), -1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.table_len = torch.zeros(batch_size, dtype=torch.long, device=device)

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
        return len(self.k)

    @property
    def width(self) -> int:
        """Slots a read covers: the longest row's length."""
        return int(self.lengths.max()) if self.batch_size else 0

    def next_positions(self) -> torch.Tensor:
        """`[b]` int64: one past each row's last cached position (0 for an empty row)."""
        return self.positions.max(dim=1).values.clamp(min=-1) + 1

    def valid(self) -> torch.Tensor:
        """`[b, capacity]` bool: filled slots."""
        return self.positions >= 0

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, batch={self.batch_size}, capacity={self.capacity}, "
                f"store={self.store!r}, policy={self.policy!r}, lengths={self.lengths.tolist()})")

    def _layer(self, layer: Any) -> int:
        return integer("layer", layer, min=0, max=self.num_layers - 1)

    # ---------------------------------------------------------------- writing
    def check_append(self, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Validate new tokens without changing anything; return the bool mask `[b, t]`.

        New positions of a row must be >= 0, strictly increasing, past the row's last cached position,
        and fit in the free slots. Masked tokens (padding) are ignored and never enter the cache.

        Args:
            positions: `[b, t]` integer logical positions.
            mask: `[b, t]` bool, False for padding (default: no padding).
        Raises:
            PosencError: naming `positions` or `mask` (a caller such as the decoder re-raises them under
                its own argument names with `posenc.errors.rename`).
        """
        b = self.batch_size
        positions = check_positions("positions", positions, shapes=[(b, "t")], allow_negative=True,
                                    device=self.positions.device).long()
        if mask is None:
            mask = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != positions.shape:
            fail("mask", f"a bool tensor of shape {tuple(positions.shape)}", mask)
        big = torch.iinfo(torch.long).max
        real = positions.masked_fill(~mask, big)  # [b, t]; padding never constrains anything
        if bool((real < 0).any()):
            fail("positions", "positions >= 0 for unmasked tokens", Raw(f"min {int(real.min())}"))
        prev = torch.cat((self.next_positions()[:, None] - 1, real), dim=1)  # [b, 1 + t]
        prev = torch.cummax(prev.masked_fill(prev == big, -1), dim=1).values[:, :-1]  # last real position before
        bad = mask & (real <= prev)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            before = int(prev[row, col])
            if bool(mask[row, :col].any()):  # the clash is inside this call, not with the cache
                what = f"row {row} strictly increasing (the token before it is at {before})"
            else:
                what = f"row {row} past its last cached position {before}"
            fail("positions", f"{what}; each position holds one token", int(positions[row, col]))
        free = self.capacity - self.lengths
        count = mask.sum(dim=1)  # [b]
        if not self.growable and bool((count > free).any()):
            row = int((count > free).nonzero()[0])
            need = int((self.lengths + count).max())
            fail("positions", f"at most {int(free[row])} new tokens in row {row} (capacity {self.capacity}, "
                 f"{int(self.lengths[row])} used); size the cache for prompt + generated tokens, e.g. "
                 f"new_cache(batch_size, capacity={need}) or more, or capacity=None to grow on demand",
                 int(count[row]))
        return mask

    def grow(self, capacity: int) -> None:
        """Enlarge every row to `capacity` slots (at least the current one); filled slots are unchanged."""
        capacity = integer("capacity", capacity, min=self.capacity, what=f"an integer >= the current capacity {self.capacity}")
        extra = capacity - self.capacity
        if extra == 0:
            return
        old = self.capacity
        k, v = _allocate(self.num_layers, (*self.k[0].shape[:2], capacity, self.k[0].shape[3]),
                         (*self.v[0].shape[:2], capacity, self.v[0].shape[3]), self.k[0].dtype, self.k[0].device)
        for new, kept in zip(k + v, self.k + self.v):
            new[:, :, :old] = kept  # [b, hk, capacity, d]: filled slots unchanged, the rest zeros
        self.k, self.v = k, v
        pad = torch.nn.functional.pad
        self.positions = pad(self.positions, (0, extra), value=-1)  # [b, capacity]
        self.tokens = pad(self.tokens, (0, extra), value=-1)

    def reserve(self, positions: torch.Tensor, mask: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Claim slots for new tokens and record their positions (and token ids, which "recompute" needs).

        Args:
            positions: `[b, t]` integer logical positions.
            mask: `[b, t]` bool, False for padding (no slot).
            tokens: `[b, t]` token ids, or None.
        Returns:
            `[b, t]` int64 slot of each token (-1 for padding), for `write`.
        Raises:
            PosencError: see `check_append`.
        """
        mask = self.check_append(positions, mask)
        positions = check_positions("positions", positions, allow_negative=True).long()  # unsigned as int64
        if tokens is not None and (not isinstance(tokens, torch.Tensor) or tokens.shape != positions.shape
                                   or tokens.dtype.is_floating_point or tokens.dtype == torch.bool):
            fail("tokens", f"None or an integer tensor of shape {tuple(positions.shape)}", tokens)
        need = int((self.lengths + mask.sum(dim=1)).max())
        if need > self.capacity:  # growable (check_append refused the rest): amortised doubling
            self.grow(max(need, 2 * self.capacity))
        slots = self.lengths[:, None] + mask.long().cumsum(dim=1) - 1  # [b, t]
        slots = slots.masked_fill(~mask, -1)
        rows, cols = mask.nonzero(as_tuple=True)
        self.positions[rows, slots[rows, cols]] = positions[rows, cols].long()
        if tokens is not None:
            self.tokens[rows, slots[rows, cols]] = tokens[rows, cols].long()
        self.lengths += mask.sum(dim=1)
        return slots

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
              index: tuple[torch.Tensor, ...] | None = None, *, rotated: bool = False) -> None:
        """Store one layer's new keys and values in their reserved slots.

        Args:
            layer: layer index.
            k: `[b, hk, t, d]` keys, NOT rotated; rotated here when `store="rotated"` and the cache has a rope.
            v: `[b, hk, t, dv]` values.
            slots: `[b, t]` from `reserve`.
            cos, sin: `[b, t, r/2]` tables of the new positions (default: `row_tables` at `table_len`).
            index: `write_index(slots)`, computed once per forward and shared by the layers (default: computed here).
            rotated: k is already rotated with `cos`/`sin` (the decoder rotates q and k of a layer in one call).
        Raises:
            PosencError: k, v or slots of other shapes than this cache's rows and heads, slots not reserved
                (checked when `index` is None: the decoder's own slots come from `reserve`).
        """
        layer = self._layer(layer)
        self._check_write(k, v, slots, values=index is None)
        if rotated and not (self.store == "rotated" and self.rope is not None):
            fail("rotated", "False for a cache that stores keys unrotated (or has no rope)", rotated)
        if self.store == "rotated" and self.rope is not None and not rotated:
            if cos is None or sin is None:
                cos, sin = self.tables(self.positions.gather(1, slots.clamp(min=0)))
            k = route.rotate(k, None, cos, sin, None, self.rope.pairing)[0]  # [b, hk, t, d]
        rows, cols, dest = self.write_index(slots) if index is None else index
        if rows is None:  # every row writes all t tokens to the same slots: one copy along the slot axis
            self.k[layer].index_copy_(2, dest, k.to(self.k[layer].dtype))  # [b, hk, t, d] -> slots dest
            self.v[layer].index_copy_(2, dest, v.to(self.v[layer].dtype))
            return
        self.k[layer][rows, :, dest] = k[rows, :, cols].to(self.k[layer].dtype)  # [n, hk, d]
        self.v[layer][rows, :, dest] = v[rows, :, cols].to(self.v[layer].dtype)

    @staticmethod
    def write_index(slots: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Where `write` puts the entries of `slots [b, t]` (computed once per forward; two host syncs).

        Returns:
            `(rows, cols, dest)` of every non-padding entry, or `(None, None, slots[0])` when every row
            writes all its tokens to the same slots (no padding, equal lengths: a plain copy).
        """
        if bool((slots >= 0).all()) and bool((slots == slots[:1]).all()):
            return None, None, slots[0]
        rows, cols = (slots >= 0).nonzero(as_tuple=True)
        return rows, cols, slots[rows, cols]

    def _check_write(self, k: Any, v: Any, slots: Any, values: bool) -> None:
        """Shapes always (no host sync); slot values (one sync) when `values`."""
        b, hk, _, d = self.k[0].shape
        slots = integer_tensor("slots", slots, ndim=(2,), what=f"an integer tensor [b={b}, t] from reserve")
        t = slots.shape[1]
        for arg, x, width in (("k", k, d), ("v", v, self.v[0].shape[-1])):
            check_float_tensor(arg, x, ndim=(4,))
            if tuple(x.shape) != (b, hk, t, width) or x.device != self.k[0].device:
                fail(arg, f"shape [{b}, {hk}, {t}, {width}] on {self.k[0].device} (rows, heads, slots' tokens, "
                     "channels)", x)
        if slots.shape[0] != b or (values and bool(((slots < -1) | (slots >= self.lengths[:, None])).any())):
            fail("slots", f"[b={b}, t] slots from reserve (-1, or below each row's length {self.lengths.tolist()})",
                 slots)

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
            width: `self.width`, when the caller already has it (one host sync per forward, not per layer).
        Returns:
            `(k [b, hk, width, d], v [b, hk, width, dv])`; pair with `positions[:, :width]` and `valid()`.
        """
        layer = self._layer(layer)
        w = self.width if width is None else width
        k, v = self.k[layer][:, :, :w], self.v[layer][:, :, :w]  # [b, hk, w, d]
        if self.store == "unrotated" and self.rope is not None:
            cos, sin = key_tables if key_tables is not None else self.tables(self.positions[:, :w])
            k = route.rotate(k, None, cos, sin, None, self.rope.pairing)[0]  # [b, hk, w, d]
        return k, v

    # ---------------------------------------------------------------- tables and policies
    def table_changes(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """`[b]` bool: filled rows whose table at `seq_lens` differs from the one their keys use."""
        changed = torch.zeros(self.batch_size, dtype=torch.bool, device=self.lengths.device)
        if self.rope is None or not self.rope.scaling.depends_on_length:
            return changed
        for row in (self.lengths > 0).nonzero().flatten().tolist():
            old = self.rope.inv_freq(int(self.table_len[row]))
            new = self.rope.inv_freq(int(seq_lens[row]))
            changed[row] = not (torch.equal(old[0], new[0]) and old[1] == new[1])
        return changed

    def retable(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Move each row to the table of `seq_lens [b]` under this cache's policy.

        Returns:
            `[b]` bool: rows the caller must re-run from their cached tokens ("recompute"; their cached
            entries are left as they are, the caller clears them). Empty rows simply adopt the new length.
        Raises:
            PosencError: policy "refuse" and a filled row whose frequencies would change (nothing is modified).
        """
        seq_lens = integer_tensor("seq_lens", seq_lens, ndim=(1,)).to(self.table_len)
        if seq_lens.shape[0] != self.batch_size:
            fail("seq_lens", f"{self.batch_size} lengths (one per row)", seq_lens)
        changed = self.table_changes(seq_lens)
        if self.policy == "refuse" and bool(changed.any()):
            row = int(changed.nonzero()[0])
            fail("policy", f"a table that stays the same (row {row} was filled at length "
                 f"{int(self.table_len[row])}; policy 'refuse')", f"length {int(seq_lens[row])}")
        if self.policy == "freeze":
            adopt = self.lengths == 0
        elif self.policy == "rerotate":
            if self.store == "rotated" and bool(changed.any()):
                self._rerotate(changed, self.positions, seq_lens)
            adopt = torch.ones_like(changed)
        else:  # recompute, or refuse with nothing changing
            adopt = ~changed if self.policy == "recompute" else torch.ones_like(changed)
        self.table_len = torch.where(adopt, seq_lens, self.table_len)
        return changed if self.policy == "recompute" else torch.zeros_like(changed)

    def _rerotate(self, rows: torch.Tensor, new_positions: torch.Tensor, new_lens: torch.Tensor) -> None:
        """Rotated storage: turn the keys of `rows` from (positions, table_len) to (new_positions, new_lens)."""
        w = self.width
        old_p, new_p = self.positions[rows, :w], new_positions[rows, :w]  # [n, w]
        cos, sin = rerotation_tables(self.rope, old_p, new_p, self.table_len[rows], new_lens[rows])  # [n, w, r/2]
        pairing = stored_pairing(self.rope)
        for k in self.k:
            k[rows, :, :w] = apply_rope(k[rows, :, :w], cos, sin, pairing=pairing)  # [n, hk, w, d]

    # ---------------------------------------------------------------- editing
    def clear(self, rows: torch.Tensor | None = None) -> None:
        """Empty the given rows (`[b]` bool; default all)."""
        if rows is None:
            rows = torch.ones_like(self.lengths, dtype=torch.bool)
        elif not isinstance(rows, torch.Tensor) or rows.dtype != torch.bool or rows.shape != self.lengths.shape:
            fail("rows", f"None or a bool tensor of shape [{self.batch_size}]", rows)
        self.positions[rows] = -1
        self.tokens[rows] = -1
        self.lengths[rows] = 0
        self.table_len[rows] = 0
        for k, v in zip(self.k, self.v):
            k[rows] = 0
            v[rows] = 0

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the filled slots where `keep [b, capacity]` is True, compacted in order; drop the rest."""
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != self.positions.shape:
            fail("keep", f"a bool tensor of shape {tuple(self.positions.shape)}", keep)
        keep = keep & self.valid()
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept slots first, in order
        self.positions = self.positions.gather(1, order).masked_fill(~keep.gather(1, order), -1)
        self.tokens = self.tokens.gather(1, order).masked_fill(~keep.gather(1, order), -1)
        self.lengths = keep.sum(dim=1)
        empty = (self.positions < 0)[:, None, :, None]  # [b, 1, cap, 1]
        for i in range(self.num_layers):
            index = order[:, None, :, None]
            self.k[i] = self.k[i].gather(2, index.expand_as(self.k[i])).masked_fill(empty, 0)
            self.v[i] = self.v[i].gather(2, index.expand_as(self.v[i])).masked_fill(empty, 0)

    def rollback(self, n: int | torch.Tensor) -> None:
        """Drop the last `n` tokens of each row (`n` int or `[b]`), e.g. rejected speculative tokens."""
        what = f"an integer (or [b={self.batch_size}] integers) in [0, lengths={self.lengths.tolist()}]"
        if isinstance(n, torch.Tensor):
            n = integer_tensor("n", n, ndim=(0, 1), what=what).to(self.lengths.device)
            if n.ndim == 1 and n.shape[0] != self.batch_size:
                fail("n", what, n)
        else:
            n = torch.tensor(integer("n", n, what=what), device=self.lengths.device)
        if bool(((n < 0) | (n > self.lengths)).any()):
            fail("n", what, Raw(str(n.tolist())))
        slot = torch.arange(self.capacity, device=self.lengths.device)
        self.keep(slot[None, :] < (self.lengths - n)[:, None])

    def reorder(self, index: torch.Tensor) -> None:
        """Rows become `old_rows[index]` (beam search); every row keeps its own positions."""
        what = f"a 1-D integer tensor of rows in [0, {self.batch_size})"
        index = integer_tensor("index", index, ndim=(1,), what=what)
        if bool(((index < 0) | (index >= self.batch_size)).any()):
            fail("index", what, Raw(str(index.tolist())))
        index = index.to(self.lengths.device)
        for name in ("positions", "tokens", "lengths", "table_len"):
            setattr(self, name, getattr(self, name)[index])
        self.k = [k[index] for k in self.k]
        self.v = [v[index] for v in self.v]

    def keep_recent(self, window: int, sinks: int = 0, *, shift: bool = False) -> None:
        """Sliding window with attention sinks (StreamingLLM): keep the first `sinks` and last `window` tokens.

        With `shift=True` the kept tokens move to contiguous positions starting at the row's first kept
        position; rotated keys are rotated by the position difference (no recomputation).

        Raises:
            PosencError: a window < 1 or sinks < 0; `shift=True` on a cache of absolute position embeddings.
        """
        window = integer("window", window, min=1, what="an integer >= 1")
        sinks = integer("sinks", sinks, min=0)
        if boolean("shift", shift) and self.absolute:
            fail("shift", "False for a cache of absolute position embeddings (its keys and values carry their "
                 "positions; re-run the kept tokens to move them)", True)
        slot = torch.arange(self.capacity, device=self.lengths.device)[None, :]  # [1, cap]
        self.keep((slot < sinks) | (slot >= self.lengths[:, None] - window))
        if shift:
            first = self.positions[:, :1].clamp(min=0)  # [b, 1]
            self.move(torch.where(self.valid(), first + slot, -1))

    def move(self, new_positions: torch.Tensor) -> None:
        """Give filled slots new positions (`[b, capacity]`, strictly increasing per row), re-rotating keys.

        Rotated storage turns each key from its old position to its new one with the row's table
        (`rerotation_tables`); unrotated storage and bias schemes just read the new positions.

        Raises:
            PosencError: positions of another shape, negative or not increasing on filled slots; a cache of
                absolute position embeddings (`absolute=True`) given positions that differ from its own.
        """
        new_positions = check_positions("new_positions", new_positions, shapes=[tuple(self.positions.shape)],
                                        allow_negative=True, device=self.positions.device)
        valid = self.valid()
        new_positions = torch.where(valid, new_positions.long(), -1)
        step = new_positions[:, 1:] - new_positions[:, :-1]
        if bool((valid & (new_positions < 0)).any()) or bool((valid[:, 1:] & (step <= 0)).any()):
            fail("new_positions", "positions >= 0, strictly increasing along each row's filled slots", new_positions)
        if self.absolute and not torch.equal(new_positions, self.positions):
            fail("new_positions", "the current positions: this cache's keys and values carry absolute position "
                 "embeddings, which cannot be moved (re-run the tokens at their new positions)", new_positions)
        if self.store == "rotated" and self.rope is not None:
            self._rerotate(self.lengths > 0, new_positions, self.table_len)
        self.positions = new_positions
