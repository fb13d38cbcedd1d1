"""`RopeTable`: the cos/sin rows of one `Rope` for positions `0 .. n-1`, a value the caller holds and passes.

A table is made by `Rope.table(n)` and handed to `apply` / `apply_` / `rotate` (and through them to the
decoder, the cache and `attention`) as `table=`: the kernels then read row `p` for position `p`, so a
decode step costs one metadata check and one kernel call, with no table work at all. Nothing in posenc
keeps tables behind the caller's back: without `table=` a call computes the rows its positions need.

Rows are bit-identical to `Rope.cos_sin(position_ids)` at the same positions (torch's float32 cos/sin do
not depend on where an element sits in a tensor; tests/kernels/test_cpu.py checks it).

    >>> import torch, posenc
    >>> rope = posenc.Rope(head_dim=8)
    >>> table = rope.table(16)
    >>> table.rows, tuple(table.cos.shape)
    (16, (16, 4))
    >>> q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    >>> a = rope.apply(q, k, torch.tensor([3, 4, 5]), table=table)
    >>> b = rope.apply(q, k, torch.tensor([3, 4, 5]))
    >>> bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import Raw, fail

if TYPE_CHECKING:
    from .spec import Rope

__all__ = ["RopeTable"]


@dataclass(frozen=True, eq=False)
class RopeTable:
    """cos/sin rows `[n, r/2]` (float32, contiguous, attention factor applied) of `rope` at positions `0 .. n-1`.

    Attributes:
        rope: the `Rope` the rows belong to (a table of another Rope is refused).
        cos, sin: `[n, r/2]` float32 tables; row p is position p.
        seq_len: the length a length-dependent scaling was evaluated at (None for a scaling that does
            not depend on the length).
        precision: "float32" or "exact", as `Rope.cos_sin`.
        held: what the CPU kernel reads of the table, `(cos address, sin address, rows, r/2, pairing code)`,
            taken once when the table is made (None for a table on another device, or rows wider than the
            kernel's buffers hold, `cpu.fits`): a decode call then reads no table metadata. A table is a
            value: its tensors are not to be changed in place.

    Made by hand, `cos` and `sin` are checked (float32 `[n, r/2]`, one shape, one device) and made contiguous.
    """

    rope: "Rope"
    cos: torch.Tensor
    sin: torch.Tensor
    seq_len: int | None
    precision: str
    held: tuple[int, int, int, int, int] | None = field(init=False, repr=False)

    def __post_init__(self):
        from ..kernels.cpu import PAIRING_CODES, fits

        cos, sin, half = self.cos, self.sin, self.rope.rotary_dim // 2
        for arg, x in (("cos", cos), ("sin", sin)):  # a table made by hand is checked like one from Rope.table
            if type(x) is not torch.Tensor or x.dtype != torch.float32 or x.ndim != 2 or x.shape[1] != half:
                fail(arg, f"a float32 tensor [n, {half}] (rotary_dim / 2 columns)", x)
        if sin.shape != cos.shape or sin.device != cos.device:
            fail("sin", f"a tensor of cos's shape {tuple(cos.shape)} on its device ({cos.device})", sin)
        cos, sin = cos.contiguous(), sin.contiguous()  # the rows the kernels read, as Rope.table makes them
        object.__setattr__(self, "cos", cos)
        object.__setattr__(self, "sin", sin)
        plain = cos.is_cpu and fits(self.rope.rotary_dim, self.rope.head_dim)  # rows the kernel's buffers hold
        held = (cos.data_ptr(), sin.data_ptr(), *cos.shape, PAIRING_CODES[self.rope.pairing]) if plain else None
        object.__setattr__(self, "held", held)

    def __reduce__(self):
        """Copies and pickles are made again from the fields (`held` points at the copy's own tensors)."""
        return type(self), (self.rope, self.cos, self.sin, self.seq_len, self.precision)

    @property
    def rows(self) -> int:
        """How many positions the table covers (`0 .. rows-1`)."""
        return self.cos.shape[0]

    @property
    def device(self) -> torch.device:
        return self.cos.device

    @property
    def pairing(self) -> str:
        return self.rope.pairing

    def check_for(self, rope: "Rope", seq_len: int | None, precision: str, x: torch.Tensor) -> None:
        """Raise `PosencError` naming `table` unless this table serves `rope` at these options for `x` (q)."""
        if self.rope is rope and seq_len is None and precision == self.precision and (
                self.cos.is_cpu and x.is_cpu or self.cos.device == x.device):
            return  # the decode hot path
        if self.rope is not rope and self.rope != rope:
            fail("table", "a table made by this Rope (rope.table(...))", Raw(f"one of {self.rope}"))
        if seq_len is not None and seq_len != self.seq_len:
            fail("seq_len", f"None or the table's seq_len {self.seq_len} (make the table with rope.table(n, "
                 "seq_len=...))", seq_len)
        if precision != self.precision:
            fail("precision", f"the table's precision {self.precision!r}", precision)
        if self.cos.device != x.device:
            fail("table", f"a table on the device of q ({x.device})", Raw(f"one on {self.cos.device}"))

    def __repr__(self) -> str:
        return (f"RopeTable(rows={self.rows}, rotary_dim={self.rope.rotary_dim}, seq_len={self.seq_len}, "
                f"precision={self.precision!r}, device={self.device})")


def make_table(rope: "Rope", rows: int, *, seq_len: int | None, precision: str, device) -> RopeTable:
    """The table of `rope` at positions `0 .. rows-1` (see `Rope.table`)."""
    from . import tables

    inv, factor = rope.angle_freq(seq_len)  # [r/2], signed by the rope's direction
    positions = torch.arange(rows, device=device)  # [n]
    cos, sin = tables.cos_sin(positions, inv, factor, precision)  # [n, r/2] each
    return RopeTable(rope, cos, sin, seq_len, precision)
