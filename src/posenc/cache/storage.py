"""Per-layer key/value storage behind `KVCache`: the store protocol and the contiguous store.

A store holds one layer's keys and values for `b` rows of `capacity` slots each. It knows nothing of
positions, RoPE or policies (the cache keeps those); it only moves entries between (row, slot) places.
`KVCache` owns one store per layer and calls nothing but the methods of `KVStore`, so another layout
(paged blocks, quantized formats) plugs in by implementing them.

Contract every store keeps:
- `write(rows [n], slots [n], k [n, hk, d], v [n, hk, dv])`: entry i goes to `(rows[i], slots[i])`; an
  entry whose slot is -1 is dropped (padding). Destinations of real entries are distinct. `v` may be
  None: keys only (re-rotation), values untouched. No host sync: the cache has already validated the
  indices, the store never reads them on the host.
- `read(width=None) -> (k [b, hk, w, d], v [b, hk, w, dv])`, the first `w` slots (`width`, default the
  capacity; 0 <= width <= capacity, the caller's to check) in the compute dtype (the cache's `dtype`):
  views for a store that keeps that dtype, fresh tensors for one that converts (which converts only
  those `w` slots). Slots never written, or cleared, read as zeros (finite: masked attention multiplies
  their values by 0).
- `copy_slots(src_rows [n], src_slots [n], dst_rows [n], dst_slots [n])` (places checked by `check_copy`
  before anything moves: PosencError naming the argument): every destination receives
  what its source held BEFORE the call (sources are read first, so overlapping moves such as compaction
  and row permutation are safe); a source slot of -1 clears the destination to zeros; a destination
  slot of -1 is dropped. No host sync (a store may reclaim space here, with one: the quantized
  per-channel key store does, so that its `write` never has to).
- `reorder(index [b'])`: rows become the old rows `index` (repeats allowed: forks). With b' == b it works
  in place (views stay live); another b' reallocates, as `grow` does. A store over shared block tables
  (paged) leaves the tables to their owner and only resizes its pools. As `copy_slots`, it may reclaim.
- `grow(capacity)`: enlarge every row to `capacity` slots (>= the current one), filled slots unchanged,
  new ones zero. The only call that allocates; tensors taken from `read()` before it go stale.
- `save(rows [n], slots [n]) -> undo` (optional): a function that puts back what a `write` to those places
  would overwrite (`KVCache.transaction()` calls it before each write; a store without it is snapshotted).
- `nbytes`: bytes held for keys and values (int), scratch included.
- `capacity`: slots per row (int).
Nothing else rebinds storage: `write` and `copy_slots` work in place, so views from `read()` stay live.

    >>> import torch
    >>> store = ContiguousStore(batch_size=2, num_kv_heads=1, capacity=3, head_dim=2)
    >>> store.write(torch.tensor([1, 0]), torch.tensor([2, -1]), torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    >>> store.read()[0][:, 0, :, 0].tolist()      # row 1 slot 2 written; row 0's entry was padding
    [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
"""

from __future__ import annotations

import math
from typing import Any, Callable, Protocol

import torch

from ..errors import Raw, assert_values, fail

__all__ = ["KVStore", "ContiguousStore", "allocate", "save_buffer_slots", "check_copy"]


class KVStore(Protocol):
    """One layer's keys and values; see the module docstring for the exact contract."""

    capacity: int

    def write(self, rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None: ...

    def read(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def copy_slots(self, src_rows: torch.Tensor, src_slots: torch.Tensor, dst_rows: torch.Tensor,
                   dst_slots: torch.Tensor) -> None: ...

    def reorder(self, index: torch.Tensor) -> None: ...

    def grow(self, capacity: int) -> None: ...

    @property
    def nbytes(self) -> int: ...


def check_copy(src_rows: torch.Tensor, src_slots: torch.Tensor, dst_rows: torch.Tensor, dst_slots: torch.Tensor,
               batch_size: int, capacity: int) -> None:
    """Refuse a `copy_slots` whose places are not `[n]` integer rows in [0, b) and slots in [-1, capacity),
    naming the first bad argument, before anything moves (values checked on the device: no host sync)."""
    n = src_rows.shape[0] if isinstance(src_rows, torch.Tensor) and src_rows.ndim == 1 else -1
    for arg, t, bound in (("src_rows", src_rows, batch_size), ("src_slots", src_slots, capacity),
                          ("dst_rows", dst_rows, batch_size), ("dst_slots", dst_slots, capacity)):
        what = f"[n] integers in [{0 if 'rows' in arg else -1}, {bound})"
        if (not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool
                or t.ndim != 1 or t.shape[0] != n):
            fail(arg, what + " (four tensors of one length)", t)
        low = 0 if "rows" in arg else -1
        assert_values(arg, ((t >= low) & (t < bound)).all(), what, lambda t=t: Raw(str(t.tolist())))


def scratch_slots(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """`slots [n]` with padding (-1) sent to the scratch slot `capacity` of a store's `[b, h, capacity + 1, .]`
    buffers, so a write or copy is one `index_put_` of fixed shape (no `nonzero`, no host sync)."""
    return torch.where(slots < 0, capacity, slots)  # [n]


def copy_buffer_slots(buffers: Any, src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor],
                      clear: torch.Tensor) -> None:
    """`KVStore.copy_slots` on `[b, h, cap+1, .]` buffers: `(rows, scratch_slots)` `src` -> `dst`, sources read
    before any write; where `clear [n, 1, 1]` the destination is zeroed (a source of -1)."""
    for buf in buffers:
        view = buf.transpose(1, 2)  # [b, cap+1, h, .]
        view.index_put_(dst, view[src].masked_fill(clear, 0))  # [n, h, .]


def save_buffer_slots(buffers: Any, at: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
    """`KVStore.save` on `[b, h, cap+1, .]` buffers: copies of the entries at `at = (rows [n], slots [n])` and
    the function that writes them back (repeated places hold one value, so the order of the writes is moot)."""
    held = [(buf, buf.transpose(1, 2)[at]) for buf in buffers]  # [n, h, .] copies (advanced indexing)

    def undo() -> None:
        for buf, old in held:
            buf.transpose(1, 2).index_put_(at, old)

    return undo


def reorder_buffer(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`buf [b, ...]` with its rows in `index [b']` order: `buf` itself, copied in place, when b' == b (callers'
    references stay valid); otherwise a gathered new tensor."""
    return buf.copy_(buf[index]) if index.shape[0] == buf.shape[0] else buf[index]


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: Any, arg: str, value: int,
             total_bytes: int) -> torch.Tensor:
    """A zeroed tensor; a size no element count or memory holds is refused naming `arg` (the culprit)."""
    if math.prod(shape) >= 2**63:  # torch's "Storage size calculation overflowed"
        fail(arg, "a size whose buffers have < 2**63 elements", value)
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
        fail(arg, f"a cache that fits in memory ({total_bytes / 2**30:.3g} GiB of keys and values asked)",
             Raw(f"{value} ({type(err).__name__})"))


class ContiguousStore:
    """`k [b, hk, capacity, d]`, `v [b, hk, capacity, dv]` in one tensor each, plus one scratch slot per row.

    Padding entries (slot -1) land in the scratch slot `capacity`, so a write is one `index_put_` of
    fixed shape whatever the padding (no `nonzero`, no host sync); `read()` never shows the scratch slot.

    Args:
        batch_size, num_kv_heads, capacity, head_dim: b, hk, slots per row, d.
        value_dim: dv (default d).
        dtype, device: of the buffers (also the compute dtype: `read()` returns views).
        layers: how many such stores the caller allocates (only for the out-of-memory message).
    Raises:
        PosencError: a capacity or batch size whose buffers overflow or do not fit in memory.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, capacity: int, head_dim: int,
                 value_dim: int | None = None, *, dtype: torch.dtype = torch.float32, device: Any = None,
                 layers: int = 1) -> None:
        self.capacity = capacity
        dv = head_dim if value_dim is None else value_dim
        self._k, self._v = self._buffers(batch_size, num_kv_heads, capacity, head_dim, dv, dtype, device, layers)

    @staticmethod
    def _buffers(b: int, hk: int, capacity: int, d: int, dv: int, dtype: torch.dtype, device: Any,
                 layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        arg, value = ("batch_size", b) if b > capacity else ("capacity", capacity)  # the culprit
        need = layers * b * hk * (capacity + 1) * (d + dv) * torch.empty((), dtype=dtype).element_size()
        return (allocate((b, hk, capacity + 1, d), dtype, device, arg, value, need),  # + 1: scratch slot
                allocate((b, hk, capacity + 1, dv), dtype, device, arg, value, need))

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def read(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.capacity if width is None else width
        return self._k[:, :, :w], self._v[:, :, :w]  # views [b, hk, w, d]

    def write(self, rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        at = (rows, scratch_slots(slots, self.capacity))
        self._k.transpose(1, 2).index_put_(at, k.to(self._k.dtype))  # [b, cap+1, hk, d] <- [n, hk, d]
        if v is not None:
            self._v.transpose(1, 2).index_put_(at, v.to(self._v.dtype))

    def save(self, rows: torch.Tensor, slots: torch.Tensor) -> Callable[[], None]:
        return save_buffer_slots((self._k, self._v), (rows, scratch_slots(slots, self.capacity)))

    def copy_slots(self, src_rows: torch.Tensor, src_slots: torch.Tensor, dst_rows: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
        check_copy(src_rows, src_slots, dst_rows, dst_slots, self._k.shape[0], self.capacity)
        copy_buffer_slots((self._k, self._v), (src_rows, scratch_slots(src_slots, self.capacity)),
                          (dst_rows, scratch_slots(dst_slots, self.capacity)), (src_slots < 0)[:, None, None])

    def reorder(self, index: torch.Tensor) -> None:
        self._k, self._v = reorder_buffer(self._k, index), reorder_buffer(self._v, index)  # [b', hk, cap+1, d]

    def grow(self, capacity: int) -> None:
        b, hk, _, d = self._k.shape
        k, v = self._buffers(b, hk, capacity, d, self._v.shape[3], self._k.dtype, self._k.device, 1)
        k[:, :, :self.capacity], v[:, :, :self.capacity] = self.read()  # filled slots unchanged, the rest zeros
        self._k, self._v, self.capacity = k, v, capacity
