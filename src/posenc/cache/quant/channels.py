"""`ChannelStore`: pre-RoPE keys quantized per channel in blocks of `group` tokens (a `QuantStore` part).

A token waits in a full-precision residual (at most `group - 1` per row, as KIVI keeps them: always a
row's last filled slots) until its block is full; then the block is encoded once. The residual buffer
keeps the raw values of a row's last `2 * group` appended slots (slot s at `s % (2 * group)`), so the
block that filled last can be reopened: a rollback that cuts into it puts its kept slots back in the
residual, raw, exactly as a cache that never saw the rolled-back tokens holds them (`raw_start [b]`:
slots from there to the row's length have their raw values; edits that move slots reset it). Every
slot records its block id (-1: empty, `RESIDUAL`: not yet encoded); the blocks' statistics live in one pool per layer shared by all rows, so `copy` and `reorder`
(forks) move codes and block ids and never re-quantize anything.

No host sync on the append path: `check_slots` and `write` work on every row at once with shapes known
on the host (a write of n entries fills at most `(n + b * (group - 1)) // group` blocks), the next free
id stays on the device, and the pool always has room for every block appends can fill before the next
edit. Ids no slot uses any more appear only at edits (`copy`, `reorder`; `grow` adds room): there the
live ids are relabelled 0.. and the pool is sized again (a host sync, as edits may make).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..storage import reorder_buffer
from ...errors import assert_values
from .codes import CodeStore, as_codes, code_bits, code_buffer, regrow
from .formats import Encoded, KVFormat, decode, encode

__all__ = ["ChannelStore", "RESIDUAL"]

RESIDUAL = -2  # block id of a slot still in the full-precision residual


class ChannelStore(CodeStore):
    """Per-channel blocks of `group` tokens, a block id per slot, a statistics pool, a full-precision residual.

    Args:
        fmt: a scaled format (int8, int4, fp8). shape: logical `(b, h, capacity, d)`. dtype: the residual's
            and `read`'s dtype. device. group: tokens per block.
    Attributes:
        codes `[b, h, cap + 1, dc]`; block `[b, cap + 1]` int32 (-1: empty, `RESIDUAL`: in the residual);
        scale/offset `[pool + 1, h, d]` float16 per block id (row `pool`: scratch); next_block: 0-d int64
        tensor on the device, the first unused id; residual `[b, h, 2 * group + 1, d]`: raw values, slot s of a
        row at `s % (2 * group)` (last index: scratch); raw_start `[b]` int64: the first slot whose raw value
        the residual holds.
    """

    def __init__(self, fmt: KVFormat, shape: tuple[int, int, int, int], dtype: torch.dtype, device: Any,
                 group: int) -> None:
        b, h, cap, d = shape
        self.fmt, self.dtype, self.dim, self.group = fmt, dtype, d, group
        self.codes = code_buffer(fmt, b, h, cap + 1, d, device)
        self.block = torch.full((b, cap + 1), -1, dtype=torch.int32, device=device)
        pool = b * (cap // group + 1)  # every block the rows can fill, and more
        stat = [torch.zeros(pool + 1, h, d, dtype=torch.float16, device=device) for _ in range(fmt.stats)]
        self.scale, self.offset = (stat + [None, None])[:2]
        self.next_block = torch.zeros((), dtype=torch.long, device=device)
        self.residual = torch.zeros(b, h, 2 * group + 1, d, dtype=dtype, device=device)
        self.raw_start = torch.zeros(b, dtype=torch.long, device=device)

    @property
    def pool(self) -> int:
        """Block ids the statistics pool holds (its scratch row not counted)."""
        return self.scale.shape[0] - 1

    @property
    def nbytes(self) -> int:
        """Codes and block ids of the `capacity` slots, statistics of the blocks in use (a host sync; not the
        fixed residual)."""
        cap = self.capacity
        used = int(torch.unique(self.block[:, :cap][self.block[:, :cap] >= 0]).numel())
        stats = sum(used * t[0].nbytes for t in (self.scale, self.offset) if t is not None)
        return self.codes.nbytes // (cap + 1) * cap + self.block.shape[0] * cap * 4 + stats

    def _fill(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`[b]` filled slots and residual tokens per row (on the device)."""
        ids = self.block[:, :self.capacity]  # [b, cap]
        return (ids != -1).sum(1), (ids == RESIDUAL).sum(1)

    def check_slots(self, rows: torch.Tensor, slots: torch.Tensor, arg: str = "slots") -> None:
        """Refuse a write that is not each row's next slots in order, below the capacity (blocks fill front to
        back). On the device (`errors.assert_values`): no host sync when the slots are right."""
        b, cap, n = self.codes.shape[0], self.capacity, slots.shape[0]
        real = slots >= 0  # [n]
        key = torch.where(real, rows, b)  # [n]: padding sorts last
        order = torch.sort(key, stable=True).indices  # [n]
        ranked = key[order]
        before = torch.arange(n, device=slots.device) - torch.searchsorted(ranked, ranked)  # [n] earlier same-row
        rank = torch.empty_like(order).index_put_((order,), before)  # [n]: entries of its row before it
        length = self._fill()[0]
        inside = (rows >= 0) & (rows < b)
        want = length[rows.clamp(0, b - 1)] + rank  # [n]
        ok = (~real | (inside & (slots == want) & (slots < cap))).all()

        def explain() -> tuple[str, Any]:
            r = int(rows[(real & ~(inside & (slots == want) & (slots < cap))).nonzero()[0, 0]])
            start = int(length[r]) if 0 <= r < b else 0
            return (f"row {r}'s next slots in order, from {start}, below capacity {cap} (a per-channel quantized "
                    "store appends; each slot is written once)", slots[(rows == r) & real])

        assert_values(arg, ok, "each row's next slots in order, below the capacity (a per-channel quantized "
                      "store appends)", explain=explain)

    def write(self, rows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Append `x [n, h, d]` to each row's residual; encode every block that fills. Call `check` and
        `check_slots` first (entries in slot order per row). No host sync: every row at once, the blocks
        staged in a buffer of a size known on the host, committed where they fill."""
        g, cap, b, dev = self.group, self.capacity, self.codes.shape[0], self.codes.device
        n, h, d = x.shape
        length, held = self._fill()  # [b]
        start = length - held  # [b] first residual slot of each row
        real = slots >= 0  # [n]
        count = torch.zeros(b, dtype=torch.long, device=dev).index_add_(0, rows, real.long())  # [b] new tokens
        full = (held + count) // g  # [b] blocks that fill
        base = full.cumsum(0) - full  # [b] the row's first staged block
        nb = (n + b * (g - 1)) // g  # at most this many fill in all; staged block nb: scratch
        q = (slots - start[rows]).clamp(min=0)  # [n] place in the row's run of residual + new tokens
        into = real & (q // g < full[rows])  # [n] the entry lands in a block that fills
        k_new, o_new = torch.where(into, base[rows] + q // g, nb), q % g  # [n] staged block, offset
        off = torch.arange(g, device=dev).expand(b, g)  # [b, g]
        done = (off < held[:, None]) & (full[:, None] > 0)  # [b, g] residual tokens whose block fills
        k_old, s_old = torch.where(done, base[:, None], nb), start[:, None] + off  # [b, g]
        res, raw = self.residual.transpose(1, 2), 2 * g  # [b, 2g + 1, h, d]
        stage = torch.zeros(nb + 1, g, h, d, dtype=self.dtype, device=dev)
        stage.index_put_((k_old, off), res[torch.arange(b, device=dev)[:, None], s_old % raw])  # [b, g, h, d]
        stage.index_put_((k_new, o_new), x.to(self.dtype))  # [n, h, d]
        enc = encode(stage.transpose(1, 2), self.fmt, "channel")  # codes [nb + 1, h, g, dc], stats [nb + 1, h, 1, d]
        total = full.sum()
        torch._assert_async(self.next_block + total <= self.pool, "ChannelStore: the statistics pool is full")
        ids = self.next_block + torch.arange(nb + 1, device=dev)  # [nb + 1]
        at = torch.where(torch.arange(nb + 1, device=dev) < total, ids, self.pool)  # unused: the scratch row
        for pool, stat in ((self.scale, enc.scale), (self.offset, enc.offset)):
            if pool is not None:
                pool.index_put_((at,), stat[:, :, 0])  # [nb + 1, h, d]
        staged = code_bits(enc.codes).transpose(1, 2)  # [nb + 1, g, h, dc]
        codes = self.codes.transpose(1, 2)  # [b, cap + 1, h, dc]
        new_at = (rows, self.slot_index(slots))
        codes.index_put_(new_at, staged[k_new, o_new].masked_fill(~into[:, None, None], 0))  # [n, h, dc]
        self.block.index_put_(new_at, torch.where(into, self.next_block + k_new, RESIDUAL).to(torch.int32))
        end = length + count  # [b]: each row's length after the write; its last 2g slots keep raw values
        keep_raw = real & (slots >= end[rows] - raw)  # [n] (one entry per residual place: no collision)
        res.index_put_((rows, torch.where(keep_raw, slots % raw, raw)), x.to(self.dtype))
        torch.maximum(self.raw_start, end - raw, out=self.raw_start)
        old_at = (torch.arange(b, device=dev)[:, None].expand(b, g), torch.where(done, s_old, cap))  # [b, g]
        codes.index_put_(old_at, staged[k_old, off].masked_fill(~done[..., None, None], 0))  # [b, g, h, dc]
        self.block.index_put_(old_at, torch.where(done, self.next_block + k_old, -1).to(torch.int32))
        self.next_block += total

    def save(self, rows: torch.Tensor, slots: torch.Tensor) -> Callable[[], None]:
        """What `write` to `(rows [n], slots [n])` would change, and the function that puts it back: codes and
        block ids of those slots and of each row's residual run (its block may fill), the pool rows the write
        may fill, the residual entries of those slots, the next free id and `raw_start`."""
        g, cap, b, dev = self.group, self.capacity, self.codes.shape[0], self.codes.device
        length, held = self._fill()
        run = ((length - held)[:, None] + torch.arange(g, device=dev)).clamp(max=cap)  # [b, g]
        at = (torch.cat((rows, torch.arange(b, device=dev).repeat_interleave(g))),
              torch.cat((self.slot_index(slots), run.flatten())))  # [n + b * g]
        nb = (slots.shape[0] + b * (g - 1)) // g
        ids = (self.next_block + torch.arange(nb + 2, device=dev)).clamp(max=self.pool)  # [nb + 2]
        ids[-1] = self.pool  # the scratch row takes the staged blocks that do not fill
        pools = [(t, t[ids]) for t in (self.scale, self.offset) if t is not None]
        codes, block, residual = self.codes, self.block, self.residual
        next_block, raw_start = self.next_block, self.raw_start
        places = (rows, torch.where(slots >= 0, slots % (2 * g), 2 * g))  # [n] the residual entries written
        old = (codes.transpose(1, 2)[at], block[at], residual.transpose(1, 2)[places], next_block.clone(),
               raw_start.clone())

        def undo() -> None:
            codes.transpose(1, 2).index_put_(at, old[0])
            block.index_put_(at, old[1])
            residual.transpose(1, 2).index_put_(places, old[2])
            next_block.copy_(old[3])
            raw_start.copy_(old[4])
            for pool, rows_before in pools:
                pool.index_put_((ids,), rows_before)

        return undo

    def _reclaim(self) -> None:
        """Relabel the live block ids 0.. (statistics move with them) and size the pool for the live ids plus
        every block the rows can fill by appending up to the capacity (host sync: edits only)."""
        cap, g = self.capacity, self.group
        self.block[:, cap] = -1  # the scratch column holds nothing
        used = self.block >= 0  # [b, cap + 1]
        live, inverse = torch.unique(self.block[used].long(), return_inverse=True)
        length, held = self._fill()
        need = live.numel() + int(((held + cap - length) // g).sum())
        have = self.pool
        size = have if need <= have else max(need, 2 * have)
        for name in ("scale", "offset"):
            t = getattr(self, name)
            if t is not None:
                out = t if size == have else t.new_zeros(size + 1, *t.shape[1:])  # [size + 1, h, d]
                out[:live.numel()] = t[live]  # same statistics under new ids (a gather: copied first)
                setattr(self, name, out)
        self.block[used] = inverse.to(torch.int32)
        self.next_block.fill_(live.numel())

    def read(self, width: int | None = None) -> torch.Tensor:
        """`[b, h, width, d]` decoded values: blocks through their statistics, the residual as stored, empty
        slots zero (no host sync)."""
        w = self.capacity if width is None else width
        ids = self.block[:, :w]  # [b, w]
        index = ids.clamp(min=0).long()
        scale, offset = (None if t is None else t[index].transpose(1, 2) for t in (self.scale, self.offset))
        codes = as_codes(self.fmt, self.codes[:, :, :w])
        out = decode(Encoded(codes, scale, offset, self.fmt.name, "channel"), self.dtype)  # [b, h, w, d]
        held = self.residual[:, :, torch.arange(w, device=ids.device) % (2 * self.group)]  # [b, h, w, d]
        out = torch.where((ids == RESIDUAL)[:, None, :, None], held, out)
        return out.masked_fill((ids == -1)[:, None, :, None], 0)

    def copy(self, src_rows: torch.Tensor, src_slots: torch.Tensor, dst_rows: torch.Tensor,
             dst_slots: torch.Tensor) -> None:
        """`KVStore.copy_slots`: codes, block ids and residual entries move; nothing is re-encoded. Then the
        ids no slot holds are reclaimed (`_reclaim`, one host sync: an edit)."""
        clear = src_slots < 0  # [n]
        src, dst = (src_rows, self.slot_index(src_slots)), (dst_rows, self.slot_index(dst_slots))
        codes = self.codes.transpose(1, 2)  # [b, cap+1, h, dc]
        moved = codes[src].masked_fill(clear[:, None, None], 0)  # [n, h, dc]: all sources read first
        ids = self.block[src].masked_fill(clear, -1)  # [n]
        raw = 2 * self.group
        held = self.residual.transpose(1, 2)  # [b, 2g+1, h, d]
        kept = held[src_rows, src_slots.clamp(min=0) % raw]  # [n, h, d]
        into = torch.where((ids == RESIDUAL) & (dst_slots >= 0), dst_slots % raw, raw)  # [n]
        relabel = (src_slots >= 0) & (dst_slots >= 0) & ((src_slots != dst_slots) | (src_rows != dst_rows))  # [n]
        codes.index_put_(dst, moved)
        self.block.index_put_(dst, ids)
        held.index_put_((dst_rows, into), kept)
        cap = self.capacity  # a row whose slots moved keeps no raw values (its residual entries did not follow)
        self.raw_start.scatter_reduce_(0, dst_rows, torch.where(relabel, cap, 0), reduce="amax")
        self._reopen_tail()
        self._reclaim()

    def _reopen_tail(self) -> None:
        """A row whose last encoded block lost its later slots (a rollback into it) and whose kept slots still have
        their raw values holds them in the residual again: as a cache that never saw the dropped tokens."""
        g, cap = self.group, self.capacity
        ids = self.block[:, :cap]  # [b, cap]
        slot = torch.arange(cap, device=ids.device)
        length = (ids != -1).sum(1)  # [b]
        self.raw_start.copy_(torch.minimum(self.raw_start, length))  # appends after the length are raw again
        last = torch.where(ids >= 0, slot, -1).max(dim=1).values  # [b] the row's last encoded slot (-1: none)
        tail = (ids == ids.gather(1, last.clamp(min=0)[:, None])) & (last >= 0)[:, None]  # [b, cap]
        count = tail.sum(1)  # [b] slots of that block the row still holds
        first = torch.where(tail, slot, cap).min(dim=1).values
        reopen = (count < g) & (first >= self.raw_start) & ((ids == RESIDUAL).sum(1) + count < g)  # [b]
        hit = tail & reopen[:, None]  # [b, cap]
        ids.masked_fill_(hit, RESIDUAL)
        self.codes[:, :, :cap].masked_fill_(hit[:, None, :, None], 0)

    def reorder(self, index: torch.Tensor) -> None:
        """Rows become the old rows `index`; forked rows share block ids (the pool is the layer's, sized again
        for the new rows: `_reclaim`, a host sync)."""
        for name in ("codes", "block", "residual", "raw_start"):
            setattr(self, name, reorder_buffer(getattr(self, name), index))
        self._reclaim()

    def grow(self, capacity: int) -> None:
        old = self.capacity
        self.codes = regrow(self.codes, old, capacity)
        self.block = regrow(self.block, old, capacity, -1)
        self._reclaim()  # room for the blocks the new slots can fill
