"""The only place RoPE angles are made: cos/sin for explicit positions, float32 or exact-phase, and
`RopeTable`, the cos/sin rows of one `Rope` for positions `0 .. n-1` that a caller holds and passes.

Tables are returned per rotation pair, `[..., r/2]`, in float32, never cached in a module buffer
(so `model.to(torch.bfloat16)` cannot cast them).

Precision (angle errors against the exact phase `p * inv_freq` of the same float32 frequencies, measured
by tests/rope/test_tables_precision.py with mpmath at d = 128, theta = 1e4 and 5e5, 33 positions ending at each p):
- `"float32"` (default): `angle = float32(p) * inv_freq`, rounded once to float32, then `cos`/`sin` in
  float32: exactly what transformers (and so the checkpoints) compute. The error is half an ulp of the
  angle, `<= |angle| * 2**-24` rad, so it grows with the position: measured max 1.9e-3 rad at p = 2**16,
  3.1e-2 at 2**20 and 0.50 at 2**24 (channel 0, `inv_freq = 1`, is exact; channel 1 carries the worst
  error). Above 2**24 `float32(p)` itself is rounded (odd positions are lost).
- `"exact"`: the same float32 frequencies, phase computed without rounding: a float32 frequency has a
  24-bit significand, so `p * inv_freq` is exact in float64 for `|p| < 2**29`; it is reduced to
  [-pi, pi] with 2*pi in three parts (Cody-Waite) and cos/sin are taken in float64. For `inv_freq <= 1`
  (any base > 1 and scaling factors >= 1) the reduced angle is within 5e-16 rad of the true phase mod
  2*pi for `|p| <= 2**24` (measured 2.2e-16 at 2**16, 2**20 and 2**24) and within 4e-15 rad for
  `|p| < 2**29`; positions at or beyond 2**29 raise. What remains is the final rounding of cos/sin to
  float32, at most 2**-25 (3e-8).

    >>> import torch
    >>> from posenc.rope.tables import cos_sin
    >>> c, s = cos_sin(torch.tensor([0, 1]), torch.tensor([1.0, 0.5]))
    >>> c.shape, float(c[0, 0]), float(s[0, 0])
    (torch.Size([2, 2]), 1.0, 0.0)

A `RopeTable` is made by `Rope.table(n)` and handed to `apply` / `apply_` / `rotate` (and through them to the
decoder, the cache and `attention`) as `table=`: the kernels then read row `p` for position `p`, so a
decode step costs one metadata check and one kernel call, with no table work at all. Nothing in posenc
keeps tables behind the caller's back: without `table=` a call computes the rows its positions need.
Rows are bit-identical to `Rope.cos_sin(position_ids)` at the same positions (torch's float32 cos/sin do
not depend on where an element sits in a tensor; tests/kernels/test_cpu.py checks it).

    >>> import posenc
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

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from ..errors import Raw, choice, fail, positions as check_positions
from ..kernels.constants import EXACT_LIMIT, PAIRING_CODES, TWO_PI_PARTS, fits

if TYPE_CHECKING:
    from .spec import Rope

__all__ = ["RopeTable", "make_table", "TWO_PI_PARTS", "angles", "cos_sin", "cos_sin_from_angles", "float32_cos_sin",
           "check_precision", "PRECISIONS"]

Precision = Literal["float32", "exact"]
PRECISIONS = ("float32", "exact")

# 2*pi in three parts (Cody-Waite, kernels/constants.py: the Triton kernels reduce phases with the same parts)
_TWO_PI_HI, _TWO_PI_MID, _TWO_PI_LO = TWO_PI_PARTS


def check_precision(precision: object) -> str:
    """The one check of a `precision=` argument: "float32" or "exact"."""
    return choice("precision", precision, PRECISIONS)


def angles(positions: torch.Tensor, inv_freq: torch.Tensor, precision: Precision = "float32") -> torch.Tensor:
    """Rotation angles `p * inv_freq`.

    Args:
        positions: integer positions of any shape `[...]`.
        inv_freq: `[r/2]` float32 inverse frequencies.
        precision: `"float32"` (checkpoint-exact) or `"exact"` (float64, reduced to [-pi, pi]).
    Returns:
        `[..., r/2]` float32 angles, or float64 reduced phases for `"exact"`.
    Raises:
        PosencError: an unknown precision, or `|position| >= 2**29` with `"exact"`.

    Example (the exact phase of position 7 at frequency 1 is 7 - 2*pi):
        >>> import math, torch
        >>> theta = angles(torch.tensor([7]), torch.tensor([1.0]), "exact")
        >>> theta.dtype, abs(float(theta[0, 0]) - (7 - 2 * math.pi)) < 1e-15
        (torch.float64, True)
    """
    check_precision(precision)
    positions = check_positions("position_ids", positions, allow_negative=True)  # no host sync; uint -> int64
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
    if precision == "float32":
        # fp32: bf16 positions lose integer precision above 256; the product is rounded once, as in transformers
        return positions.float()[..., None] * inv_freq  # [..., r/2]
    if positions.numel() and int(positions.abs().max()) >= EXACT_LIMIT:
        fail("position_ids", "|position| < 2**29 for precision='exact'", int(positions.abs().max()))
    phase = positions.double()[..., None] * inv_freq.double()  # exact: 24-bit x 29-bit significands
    turns = torch.round(phase / (2 * math.pi))
    return ((phase - turns * _TWO_PI_HI) - turns * _TWO_PI_MID) - turns * _TWO_PI_LO  # [..., r/2], in [-pi, pi] up to 1 ulp


def cos_sin_from_angles(theta: torch.Tensor, attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `theta`, times `attention_factor`, as float32 (computed in theta's precision).

    Args:
        theta: `[..., r/2]` angles (float32, or float64 from `precision="exact"`).
        attention_factor: multiplier applied to both cos and sin, as transformers applies it.
    Returns:
        `(cos, sin)`, each `[..., r/2]` float32.
    """
    cos, sin = theta.cos(), theta.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.float(), sin.float()


def cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    precision: Precision = "float32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[..., r/2]` (float32) for `positions [...]`, with the attention factor applied.

    Args:
        positions: integer positions `[...]`.
        inv_freq: `[r/2]` float32 inverse frequencies.
        attention_factor: multiplier on cos and sin.
        precision: `"float32"` or `"exact"` (see the module docstring).
    Returns:
        `(cos, sin)`, each `[..., r/2]` float32.
    """
    return cos_sin_from_angles(angles(positions, inv_freq, precision), attention_factor)


def float32_cos_sin(positions: torch.Tensor, freq: torch.Tensor,
                    attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos_sin(positions, freq, attention_factor, "float32")` for checked positions, in the fewest ops: one
    product, one cos, one sin (and the factor's two products when it is not 1).

    Bit-identical to `cos_sin`: `int * float32` converts each position to float32 (rounded once, as `.float()`)
    and multiplies in float32 (tests/rope/test_tables_decode.py compares them up to 2**53).

    Args:
        positions: integer positions `[...]`, already checked (`inputs.check_position_values`).
        freq: `[r/2]` float32 frequencies on the positions' device (signed by the rope's direction).
    Returns:
        `(cos, sin)`, each `[..., r/2]` float32.
    """
    theta = positions.unsqueeze(-1) * freq  # [..., r/2] float32
    cos, sin = theta.cos(), theta.sin_()  # sin in theta's memory: one allocation fewer (prefill tables are MBs)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


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
            kernel's buffers hold, `kernels.constants.fits`): a decode call then reads no table metadata. A table is a
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
    inv, factor = rope.angle_freq(seq_len)  # [r/2], signed by the rope's direction
    positions = torch.arange(rows, device=device)  # [n]
    cos, sin = cos_sin(positions, inv, factor, precision)  # [n, r/2] each
    return RopeTable(rope, cos, sin, seq_len, precision)
