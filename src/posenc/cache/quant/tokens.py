"""Per-token code buffers for the quantized KV cache: `TokenStore` (a `QuantStore` part) and helpers.

`TokenStore` keeps one set of float16 statistics per slot (quantized per token: values, post-RoPE keys;
also the plain casts float32 / bfloat16 / float16, which have no statistics). Like `ContiguousStore` it
keeps one scratch slot per row (slot `capacity`) where padding entries (slot -1) land; `nbytes` counts
the `capacity` slots only, so bytes per token are exact. `write` checks nothing (the caller runs `check`
first: a device-side range check, `formats.check_block`); none of `check`, `write`, `read`, `copy` and
`reorder` makes a host sync.
"""

from __future__ import annotations

from typing import Any

import torch

from ..storage import allocate, copy_buffer_slots, reorder_buffer, scratch_slots
from .formats import Encoded, KVFormat, check_block, decode, encode

__all__ = ["TokenStore"]


def _codes(fmt: KVFormat, b: int, h: int, slots: int, d: int, device: Any) -> torch.Tensor:
    """Zeroed code buffer `[b, h, slots, d]` (`d/2` bytes for int4; float8 held as its uint8 bits)."""
    dtype = torch.uint8 if fmt.storage == torch.float8_e4m3fn else fmt.storage
    dc = d // 2 if fmt.bits == 4 else d
    need = b * h * slots * dc * torch.empty((), dtype=dtype).element_size()
    return allocate((b, h, slots, dc), dtype, device, "capacity", slots - 1, need)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _as_codes(fmt: KVFormat, codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn) if fmt.storage == torch.float8_e4m3fn else codes


def _regrow(t: torch.Tensor, old: int, new: int, value: float = 0) -> torch.Tensor:
    """`t [b, ..., old + 1, ...]` along dim 2 (dim 1 for a 2-D tensor) -> `new + 1` slots, the first `old` kept."""
    dim = 1 if t.ndim == 2 else 2
    shape = list(t.shape)
    shape[dim] = new + 1
    out = torch.full(shape, value, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, old).copy_(t.narrow(dim, 0, old))  # filled slots; the scratch slot starts empty
    return out


class TokenStore:
    """Codes `[b, h, cap + 1, dc]` and float16 statistics `[b, h, cap + 1, 1]` per slot (none for casts).

    Args:
        fmt: the format. shape: logical `(b, h, capacity, d)`. dtype: what `read` returns. device.
    """

    def __init__(self, fmt: KVFormat, shape: tuple[int, int, int, int], dtype: torch.dtype, device: Any) -> None:
        b, h, cap, d = shape
        self.fmt, self.dtype, self.dim = fmt, dtype, d
        self.codes = _codes(fmt, b, h, cap + 1, d, device)  # + 1: scratch slot
        stat = [torch.zeros(b, h, cap + 1, 1, dtype=torch.float16, device=device) for _ in range(fmt.stats)]
        self.scale, self.offset = (stat + [None, None])[:2]

    @property
    def capacity(self) -> int:
        return self.codes.shape[2] - 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.codes.shape[0], self.codes.shape[1], self.capacity, self.dim)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.offset) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the `capacity` slots' codes and statistics (the scratch slot not counted)."""
        return sum(t.nbytes // (self.capacity + 1) * self.capacity for t in self.tensors())

    def check(self, x: torch.Tensor, arg: str) -> None:
        check_block(x, self.fmt, arg)

    def _slot(self, slots: torch.Tensor) -> torch.Tensor:
        return scratch_slots(slots, self.capacity)  # [n]; -1 -> the scratch slot

    def write(self, rows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Encode `x [n, h, d]` per token into `(rows [n], slots [n])` (-1: padding). Call `check` first."""
        enc = encode(x, self.fmt, "token")  # codes [n, h, dc], stats [n, h, 1]
        at = (rows, self._slot(slots))
        for buf, new in zip(self.tensors(), [t for t in enc[:3] if t is not None]):
            buf.transpose(1, 2).index_put_(at, _bits(new))  # [b, cap+1, h, .] <- [n, h, .]

    def read(self, width: int | None = None) -> torch.Tensor:
        """`[b, h, width, d]` decoded values of the first `width` slots (default: all)."""
        w = slice(0, self.capacity if width is None else width)
        scale = None if self.scale is None else self.scale[:, :, w]
        offset = None if self.offset is None else self.offset[:, :, w]
        return decode(Encoded(_as_codes(self.fmt, self.codes[:, :, w]), scale, offset, self.fmt.name, "token"),
                      self.dtype)

    def copy(self, src_rows: torch.Tensor, src_slots: torch.Tensor, dst_rows: torch.Tensor,
             dst_slots: torch.Tensor) -> None:
        """`KVStore.copy_slots` on codes and statistics: moved as stored, never re-encoded."""
        copy_buffer_slots(self.tensors(), (src_rows, self._slot(src_slots)), (dst_rows, self._slot(dst_slots)),
                          (src_slots < 0)[:, None, None])

    def reorder(self, index: torch.Tensor) -> None:
        for name in ("codes", "scale", "offset"):
            if getattr(self, name) is not None:
                setattr(self, name, reorder_buffer(getattr(self, name), index))  # [b', h, cap+1, .]

    def grow(self, capacity: int) -> None:
        old = self.capacity
        for name in ("codes", "scale", "offset"):
            if getattr(self, name) is not None:
                setattr(self, name, _regrow(getattr(self, name), old, capacity))
