"""`ChannelStore`: pre-RoPE keys quantized per channel in blocks of `group` tokens (a `QuantStore` part).

A token waits in a full-precision residual (at most `group - 1` per row, as KIVI keeps them: always a
row's last filled slots, so `slot % group` indexes them without collision) until its block is full;
then the block is encoded once. Every slot records its block id (-1: empty, `RESIDUAL`: not yet
encoded); the blocks' statistics live in one pool per layer shared by all rows, so `copy` and `reorder`
(forks) move codes and block ids and never re-quantize anything. Blocks no slot uses are reclaimed
when the pool fills. `write` reads each row's fill on the host (a sync per row); `read`, `copy` and
`reorder` make none.
"""

from __future__ import annotations

from typing import Any

import torch

from .cache.storage import reorder_buffer
from .errors import fail
from .kv_codes import TokenStore, _as_codes, _bits, _codes, _regrow
from .kv_quant import Encoded, KVFormat, decode, encode

__all__ = ["ChannelStore", "RESIDUAL"]

RESIDUAL = -2  # block id of a slot still in the full-precision residual

class ChannelStore:
    """Per-channel blocks of `group` tokens, a block id per slot, a statistics pool, a full-precision residual.

    Args:
        fmt: a scaled format (int8, int4, fp8). shape: logical `(b, h, capacity, d)`. dtype: the residual's
            and `read`'s dtype. device. group: tokens per block.
    Attributes:
        codes `[b, h, cap + 1, dc]`; block `[b, cap + 1]` int32 (-1: empty, `RESIDUAL`: in the residual);
        scale/offset `[pool, h, d]` float16 per block id; next_block: the first never-used id (host int);
        residual `[b, h, group + 1, d]`: slot s of a row at `s % group` (index `group`: scratch).
    """

    def __init__(self, fmt: KVFormat, shape: tuple[int, int, int, int], dtype: torch.dtype, device: Any,
                 group: int) -> None:
        b, h, cap, d = shape
        self.fmt, self.dtype, self.dim, self.group = fmt, dtype, d, group
        self.codes = _codes(fmt, b, h, cap + 1, d, device)
        self.block = torch.full((b, cap + 1), -1, dtype=torch.int32, device=device)
        pool = b * (cap // group + 1)
        stat = [torch.zeros(pool, h, d, dtype=torch.float16, device=device) for _ in range(fmt.stats)]
        self.scale, self.offset = (stat + [None, None])[:2]
        self.next_block = 0
        self.residual = torch.zeros(b, h, group + 1, d, dtype=dtype, device=device)

    capacity = TokenStore.capacity
    shape = TokenStore.shape
    device = TokenStore.device
    check = TokenStore.check
    _slot = TokenStore._slot

    @property
    def nbytes(self) -> int:
        """Codes and block ids of the `capacity` slots, statistics of the blocks in use (a host sync; not the
        fixed residual)."""
        cap = self.capacity
        used = int(torch.unique(self.block[:, :cap][self.block[:, :cap] >= 0]).numel())
        stats = sum(used * t[0].nbytes for t in (self.scale, self.offset) if t is not None)
        return self.codes.nbytes // (cap + 1) * cap + self.block.shape[0] * cap * 4 + stats

    def _fill(self, r: int) -> tuple[int, int]:
        """Row `r`'s filled slots and residual count (host sync)."""
        ids = self.block[r, :self.capacity]
        return int((ids != -1).sum()), int((ids == RESIDUAL).sum())

    def check_slots(self, rows: torch.Tensor, slots: torch.Tensor, arg: str = "slots") -> None:
        """Refuse a write that is not each row's next slots in order (blocks fill front to back). Host syncs."""
        for r in range(self.codes.shape[0]):
            got = slots[(rows == r) & (slots >= 0)]
            start = self._fill(r)[0]
            want = torch.arange(start, start + got.shape[0], device=slots.device)
            if not torch.equal(got.long(), want):
                fail(arg, f"row {r}'s next slots in order, from {start} (a per-channel quantized store appends; "
                     "each slot is written once)", got)

    def _allocate(self, n: int) -> torch.Tensor:
        """`[n]` fresh block ids; reclaims unused ids, then doubles the pool, when it is full (host sync)."""
        have = self.scale.shape[0]
        if self.next_block + n > have:
            used = self.block >= 0
            live, inverse = torch.unique(self.block[used].long(), return_inverse=True)
            for name in ("scale", "offset"):
                t = getattr(self, name)
                if t is not None:
                    t[:live.numel()] = t[live].clone()  # same statistics under new ids
            self.block[used] = inverse.to(torch.int32)
            self.next_block = live.numel()
            if self.next_block + n > have:
                for name in ("scale", "offset"):
                    t = getattr(self, name)
                    if t is not None:
                        extra = t.new_zeros(max(have, self.next_block + n - have), *t.shape[1:])
                        setattr(self, name, torch.cat((t, extra)))  # [pool', h, d]
        ids = torch.arange(self.next_block, self.next_block + n, device=self.block.device)
        self.next_block += n
        return ids

    def write(self, rows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Append `x [n, h, d]` to each row's residual; encode every block that fills. Call `check` and
        `check_slots` first (entries in slot order per row). Host syncs (one per row)."""
        g = self.group
        for r in range(self.codes.shape[0]):
            sel = (rows == r) & (slots >= 0)  # [n]
            new = x[sel].transpose(0, 1).to(self.dtype)  # [h, m, d]
            if new.shape[1] == 0:
                continue
            length, rc = self._fill(r)
            start = length - rc  # the residual is the row's last rc slots
            held = torch.arange(start, length, device=self.codes.device)
            both = torch.cat((self.residual[r][:, held % g], new), dim=1)  # [h, rc + m, d]
            full = both.shape[1] // g
            if full:
                enc = encode(both[:, :full * g].unflatten(1, (full, g)), self.fmt, "channel")  # [h, full, g, .]
                ids = self._allocate(full)  # [full]
                self.codes[r, :, start:start + full * g] = _bits(enc.codes).flatten(1, 2)  # [h, full * g, dc]
                for pool, stat in ((self.scale, enc.scale), (self.offset, enc.offset)):
                    if pool is not None:
                        pool[ids] = stat[:, :, 0].transpose(0, 1)  # [full, h, d]
                self.block[r, start:start + full * g] = ids.repeat_interleave(g).to(torch.int32)
            rest = torch.arange(start + full * g, length + new.shape[1], device=self.codes.device)  # [< g]
            self.residual[r][:, rest % g] = both[:, full * g:]
            self.codes[r, :, rest] = 0
            self.block[r, rest] = RESIDUAL

    def read(self, width: int | None = None) -> torch.Tensor:
        """`[b, h, width, d]` decoded values: blocks through their statistics, the residual as stored, empty
        slots zero (no host sync)."""
        w = self.capacity if width is None else width
        ids = self.block[:, :w]  # [b, w]
        index = ids.clamp(min=0).long()
        scale, offset = (None if t is None else t[index].transpose(1, 2) for t in (self.scale, self.offset))
        codes = _as_codes(self.fmt, self.codes[:, :, :w])
        out = decode(Encoded(codes, scale, offset, self.fmt.name, "channel"), self.dtype)  # [b, h, w, d]
        held = self.residual[:, :, torch.arange(w, device=ids.device) % self.group]  # [b, h, w, d]
        out = torch.where((ids == RESIDUAL)[:, None, :, None], held, out)
        return out.masked_fill((ids == -1)[:, None, :, None], 0)

    def copy(self, src_rows: torch.Tensor, src_slots: torch.Tensor, dst_rows: torch.Tensor,
             dst_slots: torch.Tensor) -> None:
        """`KVStore.copy_slots`: codes, block ids and residual entries move; nothing is re-encoded (no sync)."""
        clear = src_slots < 0  # [n]
        src, dst = (src_rows, self._slot(src_slots)), (dst_rows, self._slot(dst_slots))
        codes = self.codes.transpose(1, 2)  # [b, cap+1, h, dc]
        moved = codes[src].masked_fill(clear[:, None, None], 0)  # [n, h, dc]: all sources read first
        ids = self.block[src].masked_fill(clear, -1)  # [n]
        held = self.residual.transpose(1, 2)  # [b, g+1, h, d]
        kept = held[src_rows, src_slots.clamp(min=0) % self.group]  # [n, h, d]
        into = torch.where((ids == RESIDUAL) & (dst_slots >= 0), dst_slots % self.group, self.group)  # [n]
        codes.index_put_(dst, moved)
        self.block.index_put_(dst, ids)
        held.index_put_((dst_rows, into), kept)

    def reorder(self, index: torch.Tensor) -> None:
        """Rows become the old rows `index`; forked rows share block ids (the pool is the layer's)."""
        for name in ("codes", "block", "residual"):
            setattr(self, name, reorder_buffer(getattr(self, name), index))

    def grow(self, capacity: int) -> None:
        old = self.capacity
        self.codes = _regrow(self.codes, old, capacity)
        self.block = _regrow(self.block, old, capacity, -1)
