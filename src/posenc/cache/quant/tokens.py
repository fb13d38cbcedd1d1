"""Per-token code buffers for the quantized KV cache: `TokenStore` (a `QuantStore` part).

`TokenStore` keeps one set of float16 statistics per slot (quantized per token: values, post-RoPE keys;
also the plain casts float32 / bfloat16 / float16, which have no statistics). Like `ContiguousStore` it
keeps one scratch slot per row (slot `capacity`) where padding entries (slot -1) land; `nbytes` counts
the `capacity` slots only, so bytes per token are exact. `write` checks nothing (the caller runs `check`
first: a device-side range check, `formats.check_block`); none of `check`, `write`, `read`, `copy` and
`reorder` makes a host sync.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..storage import copy_buffer_slots, reorder_buffer, save_buffer_slots
from .codes import CodeStore, as_codes, code_bits, code_buffer, regrow
from .formats import Encoded, KVFormat, decode, encode

__all__ = ["TokenStore"]


class TokenStore(CodeStore):
    """Codes `[b, h, cap + 1, dc]` and float16 statistics `[b, h, cap + 1, 1]` per slot (none for casts).

    Args:
        fmt: the format. shape: logical `(b, h, capacity, d)`. dtype: what `read` returns. device.
    """

    def __init__(self, fmt: KVFormat, shape: tuple[int, int, int, int], dtype: torch.dtype, device: Any) -> None:
        b, h, cap, d = shape
        self.fmt, self.dtype, self.dim = fmt, dtype, d
        self.codes = code_buffer(fmt, b, h, cap + 1, d, device)  # + 1: scratch slot
        stat = [torch.zeros(b, h, cap + 1, 1, dtype=torch.float16, device=device) for _ in range(fmt.stats)]
        self.scale, self.offset = (stat + [None, None])[:2]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.offset) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the `capacity` slots' codes and statistics (the scratch slot not counted)."""
        return sum(t.nbytes // (self.capacity + 1) * self.capacity for t in self.tensors())

    def write(self, rows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Encode `x [n, h, d]` per token into `(rows [n], slots [n])` (-1: padding). Call `check` first."""
        enc = encode(x, self.fmt, "token")  # codes [n, h, dc], stats [n, h, 1]
        at = (rows, self.slot_index(slots))
        for buf, new in zip(self.tensors(), [t for t in enc[:3] if t is not None]):
            buf.transpose(1, 2).index_put_(at, code_bits(new))  # [b, cap+1, h, .] <- [n, h, .]

    def read(self, width: int | None = None) -> torch.Tensor:
        """`[b, h, width, d]` decoded values of the first `width` slots (default: all)."""
        w = slice(0, self.capacity if width is None else width)
        scale = None if self.scale is None else self.scale[:, :, w]
        offset = None if self.offset is None else self.offset[:, :, w]
        return decode(Encoded(as_codes(self.fmt, self.codes[:, :, w]), scale, offset, self.fmt.name, "token"),
                      self.dtype)

    def save(self, rows: torch.Tensor, slots: torch.Tensor) -> Callable[[], None]:
        """What `write` to `(rows, slots)` would overwrite, and the function that puts it back."""
        return save_buffer_slots(self.tensors(), (rows, self.slot_index(slots)))

    def copy(self, src_rows: torch.Tensor, src_slots: torch.Tensor, dst_rows: torch.Tensor,
             dst_slots: torch.Tensor) -> None:
        """`KVStore.copy_slots` on codes and statistics: moved as stored, never re-encoded."""
        copy_buffer_slots(self.tensors(), (src_rows, self.slot_index(src_slots)),
                          (dst_rows, self.slot_index(dst_slots)),
                          (src_slots < 0)[:, None, None])

    def reorder(self, index: torch.Tensor) -> None:
        for name in ("codes", "scale", "offset"):
            if getattr(self, name) is not None:
                setattr(self, name, reorder_buffer(getattr(self, name), index))  # [b', h, cap+1, .]

    def grow(self, capacity: int) -> None:
        old = self.capacity
        for name in ("codes", "scale", "offset"):
            if getattr(self, name) is not None:
                setattr(self, name, regrow(getattr(self, name), old, capacity))
