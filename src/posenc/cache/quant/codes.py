"""What the two quantized parts (`TokenStore`, `ChannelStore`) share: code buffers and `CodeStore`.

A part keeps codes `[b, h, capacity + 1, dc]` (`dc = d / 2` for int4; float8 held as its uint8 bits) with
one scratch slot per row (slot `capacity`) where padding entries (slot -1) land, so a write or copy is one
`index_put_` of fixed shape. These helpers allocate, view and regrow such buffers; `CodeStore` is the base
class holding the facts both parts read off their codes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..storage import allocate, scratch_slots
from .formats import KVFormat, check_block

__all__ = ["CodeStore", "code_buffer", "code_bits", "as_codes", "regrow"]


def code_buffer(fmt: KVFormat, b: int, h: int, slots: int, d: int, device: Any) -> torch.Tensor:
    """Zeroed code buffer `[b, h, slots, dc]` (`d/2` bytes for int4; float8 held as its uint8 bits)."""
    dtype = torch.uint8 if fmt.storage == torch.float8_e4m3fn else fmt.storage
    dc = d // 2 if fmt.bits == 4 else d
    need = b * h * slots * dc * torch.empty((), dtype=dtype).element_size()
    return allocate((b, h, slots, dc), dtype, device, "capacity", slots - 1, need)


def code_bits(codes: torch.Tensor) -> torch.Tensor:
    """Codes as the buffer holds them: float8 viewed as uint8 bits, other codes as they are."""
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes


def as_codes(fmt: KVFormat, buffer: torch.Tensor) -> torch.Tensor:
    """The inverse of `code_bits`: a buffer viewed as `fmt`'s codes (uint8 bits -> float8 for fp8)."""
    return buffer.view(torch.float8_e4m3fn) if fmt.storage == torch.float8_e4m3fn else buffer


def regrow(t: torch.Tensor, old: int, new: int, value: float = 0) -> torch.Tensor:
    """`t [b, ..., old + 1, ...]` along dim 2 (dim 1 for a 2-D tensor) -> `new + 1` slots, the first `old` kept."""
    dim = 1 if t.ndim == 2 else 2
    shape = list(t.shape)
    shape[dim] = new + 1
    out = torch.full(shape, value, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, old).copy_(t.narrow(dim, 0, old))  # filled slots; the scratch slot starts empty
    return out


class CodeStore:
    """Base of a quantized part: `fmt`, `dtype` (what `read` returns), `dim` (d) and `codes [b, h, cap + 1, dc]`,
    which a subclass sets in its `__init__`."""

    fmt: KVFormat
    dtype: torch.dtype
    dim: int
    codes: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.codes.shape[2] - 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical `(b, h, capacity, d)`."""
        return (self.codes.shape[0], self.codes.shape[1], self.capacity, self.dim)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def check(self, x: torch.Tensor, arg: str) -> None:
        """Refuse values outside the format's range (on the device: `formats.check_block`), naming `arg`."""
        check_block(x, self.fmt, arg)

    def slot_index(self, slots: torch.Tensor) -> torch.Tensor:
        """`slots [n]` with padding (-1) sent to the scratch slot."""
        return scratch_slots(slots, self.capacity)  # [n]
