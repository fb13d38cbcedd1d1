"""`RopeTables`, a base of `Rope`: what a `Rope` computes from its fields, frequencies and cos/sin rows.

`Rope` (rope/spec.py) is the frozen description and its rotation calls; the checks of its fields and inputs
are the other base, `RopeChecks` (rope/spec_checks.py). The angles themselves are made in rope/tables.py
(and rope/mrope.py for multi-axis positions); a held table is a `RopeTable` (rope/table.py).
"""

from __future__ import annotations

import torch

from ..errors import fail, integer, positions
from . import route
from . import tables
from .mrope import mrope_axis_map, mrope_cos_sin
from .scaling import check_seq_len
from .table import RopeTable, make_table

__all__ = ["RopeTables"]


class RopeTables:
    """The frequencies and tables of `Rope` (a base class; it reads the fields `Rope` declares)."""

    # ---------------------------------------------------------------- facts
    @property
    def interleaved(self) -> bool:
        """True when input channels pair as (2i, 2i+1)."""
        return self.pairing != "split_half"

    @property
    def attention_factor(self) -> float:
        """The multiplier applied to cos and sin (YaRN, LongRoPE), at the original length."""
        return self.inv_freq()[1]

    def inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`([rotary_dim/2] float32 inverse frequencies, attention_factor)` at sequence length `seq_len`."""
        return self.scaling.inv_freq(self.base, self.rotary_dim, seq_len)  # type: ignore[arg-type]

    def angle_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`inv_freq(seq_len)` with the rotation's sign: the angle of position p is `p * angle_freq[i]`."""
        inv, factor = self.inv_freq(seq_len)
        return (inv if self.direction == 1 else -inv), factor  # negation is exact: sin(-x) = -sin(x)

    def seq_len_for(self, position_ids: torch.Tensor, seq_len: int | None = None) -> int | None:
        """The length a length-dependent scaling sees: `seq_len` if given, else `max(position_ids) + 1`."""
        if seq_len is not None:
            return check_seq_len(seq_len)
        if not self.scaling.depends_on_length or position_ids.numel() == 0:
            return None
        return int(position_ids.max()) + 1

    # ---------------------------------------------------------------- tables
    def cos_sin(
        self,
        position_ids: torch.Tensor,
        *,
        seq_len: int | None = None,
        precision: str = "float32",
        allow_negative: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables for explicit positions, attention factor applied.

        Args:
            position_ids: `[t]`, `[b, t]`, or `[3, b, t]` for multi-axis RoPE (integer).
            seq_len: the length a length-dependent scaling uses (default `max(position_ids) + 1`).
            precision: "float32" (as checkpoints compute) or "exact" (float64 phase, see `tables`).
            allow_negative: accept negative positions (rotating backwards).
        Returns:
            `(cos, sin)`, float32, `[t, r/2]` or `[b, t, r/2]`, on the positions' device.
        Raises:
            PosencError: positions that are not integer `[t]`, `[b, t]` or `[3, b, t]` (for multi-axis
                RoPE) tensors, negative positions unless allowed, a bad `seq_len` or `precision`.
        """
        position_ids = positions("position_ids", position_ids, shapes=[("t",), ("b", "t"), (3, "b", "t")],
                                 allow_negative=allow_negative,
                                 negative_hint="(pass allow_negative=True to rotate backwards)")
        multi_axis = position_ids.ndim == 3
        if multi_axis and (self.mrope_section is None or position_ids.shape[0] != 3):
            expected = "[3, b, t] positions" if self.mrope_section else "[t] or [b, t] (this Rope has no mrope_section)"
            fail("position_ids", expected, position_ids)
        tables.check_precision(precision)
        inv, factor = self.angle_freq(self.seq_len_for(position_ids, seq_len))
        if multi_axis:  # [b, t, r/2], each frequency from the axis that drives it
            return mrope_cos_sin(position_ids, inv, self.mrope_section, interleaved=self.mrope_interleaved,
                                 attention_factor=factor, precision=precision)
        return tables.cos_sin(position_ids, inv, factor, precision)  # [..., r/2]

    def table(self, rows: int, *, seq_len: int | None = None, precision: str = "float32",
              device: torch.device | str | None = None) -> RopeTable:
        """The cos/sin rows of positions `0 .. rows-1`: a value to hold and pass as `table=` (see `RopeTable`).

        Args:
            rows: how many positions the table covers (a position >= rows is refused by the calls).
            seq_len: the length a length-dependent scaling (dynamic NTK, LongRoPE) is evaluated at
                (default: `rows`, the longest sequence the table serves); ignored by other scalings.
            precision: "float32" or "exact" (see `cos_sin`).
            device: where the table lives (that of the q and k it will rotate); default CPU.
        Returns:
            A frozen `RopeTable`; `apply(q, k, position_ids, table=table)` reads row p for position p.
        Raises:
            PosencError: a non-positive `rows`, a bad `seq_len` or `precision`.
        """
        rows = integer("rows", rows, min=1)
        tables.check_precision(precision)
        if self.scaling.depends_on_length:
            seq_len = check_seq_len(rows if seq_len is None else seq_len)
        elif seq_len is not None:
            check_seq_len(seq_len)
            seq_len = None  # the frequencies do not depend on it
        return make_table(self, rows, seq_len=seq_len, precision=precision,
                          device=torch.device("cpu") if device is None else torch.device(device))

    def _tables_for(self, position_ids, table, seq_len, precision, allow_negative, x):
        """`(cos, sin, rows)` for `route.rotate`: a held table and the positions as its rows, or per-token tables."""
        if table is None:
            cos, sin = self.cos_sin(position_ids, seq_len=seq_len, precision=precision, allow_negative=allow_negative)
            return cos, sin, None  # [t, r/2] or [b, t, r/2]
        if not isinstance(table, RopeTable):
            fail("table", "a RopeTable (rope.table(n)) or None", table)
        table.check_for(self, seq_len, precision, x)
        if position_ids.ndim == 3:  # M-RoPE: each frequency from the row of the axis that drives it
            if self.mrope_section is None or position_ids.shape[0] != 3:
                fail("position_ids", "[t] or [b, t] (this Rope has no mrope_section)", position_ids)
            route.check_rows(position_ids, table.rows, "position_ids")
            axis = mrope_axis_map(self.mrope_section, self.mrope_interleaved).to(x.device)  # [r/2]
            pick = position_ids[axis].permute(1, 2, 0)  # [b, t, r/2]: the position of each frequency
            column = torch.arange(axis.shape[0], device=x.device)  # [r/2]
            return table.cos[pick, column], table.sin[pick, column], None  # [b, t, r/2]
        return table.cos, table.sin, position_ids if position_ids.dtype == torch.int64 else position_ids.long()
