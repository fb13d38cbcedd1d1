"""Per-layer quantized stores of keys or values: codes per slot, decoded on read.

`TokenStore` keeps one set of float16 statistics per slot (quantized per token: values, post-RoPE keys;
also the plain casts float32 / bfloat16 / float16, which have no statistics).

`ChannelStore` quantizes per channel over blocks of `group` consecutive tokens (pre-RoPE keys). A token
waits in a full-precision residual (at most `group - 1` per row, as KIVI keeps them) until its block is
full, then the block is encoded once. Every slot records its block id; statistics live in a per-row
table of blocks. So dropping, compacting or reordering slots (rollback, keep_recent, reorder) moves codes
and block ids and never re-quantizes anything; an unrotated store never re-quantizes on `move` either.

Both expose the logical `shape [b, h, capacity, d]` and `device` a KVCache checks writes against.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import fail
from .kv_quant import Encoded, KVFormat, check_block, decode, encode

__all__ = ["TokenStore", "ChannelStore", "DEFAULT_GROUP"]

DEFAULT_GROUP = 64  # tokens per per-channel block: its d float16 stats cost as much per token as per-token stats at d=64


def _codes(fmt: KVFormat, b: int, h: int, cap: int, d: int, device: Any) -> torch.Tensor:
    """Zeroed code buffer `[b, h, cap, d]` (`d/2` bytes for int4; float8 held as its uint8 bits)."""
    dtype = torch.uint8 if fmt.storage == torch.float8_e4m3fn else fmt.storage
    return torch.zeros(b, h, cap, d // 2 if fmt.bits == 4 else d, dtype=dtype, device=device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _as_codes(fmt: KVFormat, codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn) if fmt.storage == torch.float8_e4m3fn else codes


def _pad_slots(t: torch.Tensor, dim: int, extra: int, value: float = 0) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat((t, torch.full(shape, value, dtype=t.dtype, device=t.device)), dim=dim)


class TokenStore:
    """Codes `[b, h, cap, d]` and float16 statistics `[b, h, cap, 1]` per slot (none for casts).

    Args:
        fmt: the format. shape: logical `(b, h, capacity, d)`. dtype: what `read` returns. device.
    """

    def __init__(self, fmt: KVFormat, shape: tuple[int, int, int, int], dtype: torch.dtype, device: Any) -> None:
        b, h, cap, d = shape
        self.fmt, self.dtype, self.dim = fmt, dtype, d
        self.codes = _codes(fmt, b, h, cap, d, device)
        stat = [torch.zeros(b, h, cap, 1, dtype=torch.float16, device=device) for _ in range(fmt.stats)]
        self.scale, self.offset = (stat + [None, None])[:2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (*self.codes.shape[:3], self.dim)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.offset) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def check(self, x: torch.Tensor, arg: str) -> None:
        check_block(x, self.fmt, arg)

    def write(self, x: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None, dest: torch.Tensor,
              arg: str = "x") -> None:
        """Encode `x [b, h, t, d]` per token into slots `dest` (`rows`/`cols` as `KVCache.write_index`)."""
        enc = encode(x, self.fmt, "token", arg=arg)  # codes [b, h, t, dc], stats [b, h, t, 1]
        for store, new in zip(self.tensors(), [t for t in enc[:3] if t is not None]):
            new = _bits(new)
            if rows is None:
                store.index_copy_(2, dest, new)  # [b, h, t, .] -> slots dest
            else:
                store[rows, :, dest] = new[rows, :, cols]  # [n, h, .]

    def read(self, width: int) -> torch.Tensor:
        """`[b, h, width, d]` decoded values of the first `width` slots."""
        w = slice(0, width)
        scale = None if self.scale is None else self.scale[:, :, w]
        offset = None if self.offset is None else self.offset[:, :, w]
        return decode(Encoded(_as_codes(self.fmt, self.codes[:, :, w]), scale, offset, self.fmt.name, "token"),
                      self.dtype)

    def rewrite(self, rows: torch.Tensor, width: int, x: torch.Tensor) -> None:
        """Re-encode the first `width` slots of `rows [b]` bool from `x [n, h, width, d]` (rotated re-rotation)."""
        enc = encode(x, self.fmt, "token")
        for store, new in zip(self.tensors(), [t for t in enc[:3] if t is not None]):
            store[rows, :, :width] = _bits(new)

    def keep(self, keep: torch.Tensor, order: torch.Tensor, kept: torch.Tensor) -> None:
        """Slot j of each row takes old slot `order[:, j]`; slots where `kept [b, cap]` is False are zeroed."""
        for name in ("codes", "scale", "offset"):
            t = getattr(self, name)
            if t is not None:
                t = t.gather(2, order[:, None, :, None].expand_as(t))  # [b, h, cap, .]
                setattr(self, name, t.masked_fill(~kept[:, None, :, None], 0))

    def select(self, index: torch.Tensor) -> "TokenStore":
        """A store whose rows are `self`'s rows at `index [n]`."""
        new = object.__new__(TokenStore)
        new.fmt, new.dtype, new.dim = self.fmt, self.dtype, self.dim
        new.codes = self.codes[index]
        new.scale, new.offset = (None if t is None else t[index] for t in (self.scale, self.offset))
        return new

    __getitem__ = select  # KVCache.reorder: `[k[index] for k in self.k]`

    def clear(self, rows: torch.Tensor) -> None:
        for t in self.tensors():
            t[rows] = 0

    def grow(self, capacity: int) -> None:
        extra = capacity - self.codes.shape[2]
        for name in ("codes", "scale", "offset"):
            if getattr(self, name) is not None:
                setattr(self, name, _pad_slots(getattr(self, name), 2, extra))


class ChannelStore:
    """Per-channel blocks of `group` tokens, a block id per slot, and a full-precision residual per row.

    Args:
        fmt: a scaled format (int8, int4, fp8). shape: logical `(b, h, capacity, d)`. dtype: the residual's
            and `read`'s dtype. device. group: tokens per block.
    Attributes:
        codes `[b, h, cap, dc]`; block `[b, cap]` int32 (-1: empty or residual); scale/offset `[b, h, blocks, d]`
        float16; used `[b]` blocks in use; residual `[b, h, group, d]`; res_start/res_count `[b]`: the
        residual holds slots `res_start .. res_start + res_count - 1` (always a row's last slots).
    """

    def __init__(self, fmt: KVFormat, shape: tuple[int, int, int, int], dtype: torch.dtype, device: Any,
                 group: int) -> None:
        b, h, cap, d = shape
        self.fmt, self.dtype, self.dim, self.group = fmt, dtype, d, group
        self.codes = _codes(fmt, b, h, cap, d, device)
        self.block = torch.full((b, cap), -1, dtype=torch.int32, device=device)
        blocks = cap // group + 1
        stat = [torch.zeros(b, h, blocks, d, dtype=torch.float16, device=device) for _ in range(fmt.stats)]
        self.scale, self.offset = (stat + [None, None])[:2]
        self.used = torch.zeros(b, dtype=torch.long)
        self.residual = torch.zeros(b, h, group, d, dtype=dtype, device=device)
        self.res_start = torch.zeros(b, dtype=torch.long)
        self.res_count = torch.zeros(b, dtype=torch.long)

    shape = TokenStore.shape
    device = TokenStore.device

    @property
    def nbytes(self) -> int:
        """Codes, block ids and the statistics of the blocks in use (not the fixed residual)."""
        stats = sum(int(self.used.sum()) * t.shape[1] * t.shape[3] * t.element_size()
                    for t in (self.scale, self.offset) if t is not None)
        return self.codes.numel() * self.codes.element_size() + self.block.numel() * 4 + stats

    check = TokenStore.check

    def check_slots(self, rows: torch.Tensor | None, dest: torch.Tensor, arg: str = "slots") -> None:
        """Refuse a write that is not each row's next slots in order (blocks fill front to back)."""
        b, t = self.codes.shape[0], dest.shape[0]
        for r in range(b):
            got = dest if rows is None else dest[rows == r]
            want = torch.arange(int(got.shape[0]), device=dest.device) + int(self.res_start[r] + self.res_count[r])
            if not torch.equal(got.to(want), want):
                fail(arg, f"row {r}'s next slots in order, from {int(want[0]) if len(want) else 0} (a per-channel "
                     "quantized store appends; each slot is written once)", got)

    def write(self, x: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None, dest: torch.Tensor,
              arg: str = "x") -> None:
        """Append `x [b, h, t, d]` to each row's residual; encode every block that fills (call `check_slots` first)."""
        g = self.group
        for r in range(x.shape[0]):
            new = x[r] if rows is None else x[r][:, cols[rows == r]]  # [h, n, d]
            if new.shape[1] == 0:
                continue
            rc, start = int(self.res_count[r]), int(self.res_start[r])
            both = torch.cat((self.residual[r, :, :rc], new.to(self.dtype)), dim=1)  # [h, rc + n, d]
            full = both.shape[1] // g
            if full:
                enc = encode(both[:, :full * g].unflatten(1, (full, g)), self.fmt, "channel", arg=arg)  # [h, full, g, .]
                self.codes[r, :, start:start + full * g] = _bits(enc.codes).flatten(1, 2)  # [h, full * g, dc]
                ids = int(self.used[r]) + torch.arange(full, device=self.block.device)
                self._room(int(ids[-1]) + 1)
                for store, stat in ((self.scale, enc.scale), (self.offset, enc.offset)):
                    if store is not None:
                        store[r, :, ids] = stat[:, :, 0]  # [h, full, d]
                self.block[r, start:start + full * g] = ids.repeat_interleave(g).to(torch.int32)
                self.used[r] += full
                self.res_start[r] = start + full * g
            rest = both[:, full * g:]  # [h, < g, d]
            self.residual[r, :, :rest.shape[1]] = rest
            self.res_count[r] = rest.shape[1]

    def _room(self, blocks: int) -> None:
        have = self.scale.shape[2]
        if blocks > have:
            for name in ("scale", "offset"):
                if getattr(self, name) is not None:
                    setattr(self, name, _pad_slots(getattr(self, name), 2, max(blocks, 2 * have) - have))

    def read(self, width: int) -> torch.Tensor:
        """`[b, h, width, d]` decoded values: blocks through their statistics, the residual as stored."""
        b, h, _, d = self.shape
        index = self.block[:, None, :width, None].long().clamp(min=0).expand(b, h, width, d)  # [b, h, w, d]
        scale, offset = (None if t is None else t.gather(2, index) for t in (self.scale, self.offset))
        codes = _as_codes(self.fmt, self.codes[:, :, :width])
        out = decode(Encoded(codes, scale, offset, self.fmt.name, "channel"), self.dtype)  # [b, h, w, d]
        for r in self.res_count.nonzero().flatten().tolist():
            start, rc = int(self.res_start[r]), int(self.res_count[r])
            out[r, :, start:start + rc] = self.residual[r, :, :rc][:, :max(0, width - start)]
        return out

    def keep(self, keep: torch.Tensor, order: torch.Tensor, kept: torch.Tensor) -> None:
        """As `TokenStore.keep` (`keep [b, cap]`: old slots kept); blocks no slot uses are dropped from the table."""
        self.codes = self.codes.gather(2, order[:, None, :, None].expand_as(self.codes))
        self.codes = self.codes.masked_fill(~kept[:, None, :, None], 0)
        self.block = self.block.gather(1, order).masked_fill(~kept, -1)
        for r in range(self.block.shape[0]):
            start, rc = int(self.res_start[r]), int(self.res_count[r])
            stay = keep[r, start:start + rc].to(self.residual.device)  # [rc] residual tokens kept
            self.residual[r, :, :int(stay.sum())] = self.residual[r, :, :rc][:, stay]
            self.res_start[r], self.res_count[r] = int(keep[r, :start].sum()), int(stay.sum())
            used = self.block[r] >= 0
            ids, inverse = torch.unique(self.block[r][used].long(), return_inverse=True)  # sorted block ids
            for store in (self.scale, self.offset):
                if store is not None:
                    store[r, :, :len(ids)] = store[r, :, ids].clone()  # [h, n, d]: same values, new ids
            self.block[r][used] = inverse.to(torch.int32)
            self.used[r] = len(ids)

    def select(self, index: torch.Tensor) -> "ChannelStore":
        new = object.__new__(ChannelStore)
        new.fmt, new.dtype, new.dim, new.group = self.fmt, self.dtype, self.dim, self.group
        for name in ("codes", "block", "scale", "offset", "residual"):
            setattr(new, name, None if getattr(self, name) is None else getattr(self, name)[index])
        cpu = index.cpu()
        new.used, new.res_start, new.res_count = self.used[cpu], self.res_start[cpu], self.res_count[cpu]
        return new

    __getitem__ = select

    def clear(self, rows: torch.Tensor) -> None:
        self.codes[rows] = 0
        self.block[rows] = -1
        cpu = rows.cpu()
        for t in (self.used, self.res_start, self.res_count):
            t[cpu] = 0

    def grow(self, capacity: int) -> None:
        extra = capacity - self.codes.shape[2]
        self.codes = _pad_slots(self.codes, 2, extra)
        self.block = _pad_slots(self.block, 1, extra, -1)
