"""`Rope`: a frozen description of one rotary embedding, and the calls that use it.

The fields and their checks, the frequencies (`inv_freq`, `angle_freq`), the cos/sin rows (`cos_sin`, a held
`table`) and the rotation calls (`rotate`, `apply`, `apply_`). The checks of call inputs are plain functions in
rope/inputs.py; the angles are made in rope/tables.py; the implementation is chosen in rope/dispatch.py.

    >>> import torch, posenc
    >>> rope = posenc.Rope(head_dim=8, base=10000.0)
    >>> q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)     # GQA: 4 query heads, 2 key heads
    >>> q2, k2 = rope.apply(q, k, torch.arange(5))
    >>> q2.shape, k2.shape
    (torch.Size([1, 4, 5, 8]), torch.Size([1, 2, 5, 8]))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import boolean, choice, fail, integer, positions, real
from ..kernels.constants import PAIRING_CODES, fits
from . import dispatch, tables
from .apply import PAIRINGS
from .fast import cos_sin_fresh, rotate_fresh, rotate_held
from .inputs import check_pair, check_position_values, check_positions, check_x
from .mrope import check_sections, mrope_axis_map, mrope_cos_sin
from .scaling import Default, Scaling, check_base, check_seq_len
from .tables import RopeTable, make_table

__all__ = ["Rope"]

# bound once: the decode hot path calls them
_compiling, Tensor, _INT64 = torch.compiler.is_compiling, torch.Tensor, torch.int64


@dataclass(frozen=True)
class Rope:
    """One rotary position embedding.

    Args:
        head_dim: channels per q/k head that this embedding sees (for DeepSeek MLA, the rope slice).
        rotary_dim: leading channels that rotate (default: all); the rest pass through unchanged.
        base: theta, the base of the frequency ladder.
        scaling: a scaling rule from `posenc.rope.scaling` (default: none).
        pairing: "split_half", "interleaved" or "interleaved_to_split_half" (see `apply_rope`).
        mrope_section: frequencies per position axis for multi-axis RoPE (sums to rotary_dim / 2).
        mrope_interleaved: Qwen3-VL's interleaved axis assignment instead of contiguous sections.
        softmax_scale_factor: extra multiplier on the attention softmax scale that the model applies
            (DeepSeek YaRN: `mscale(factor, mscale_all_dim)**2`); 1 for every other model.
        direction: 1 (position p turns pair i by `+p * inv_freq[i]`, every model but one) or -1 (by
            `-p * inv_freq[i]`: nanochat, whose rotate_half is `cat(x2, -x1)`). It is the sign of the angles
            in every table (`cos_sin`, `table`); `inv_freq` stays the positive ladder.

    The frequency ladder of a scaling that does not depend on the length is computed once, here, and kept
    with the value (on the CPU, whatever the default device), so a call without a table computes only the
    angles of the positions it is given.

    Raises:
        PosencError: odd or out-of-range widths, a non-positive or non-finite base, unknown pairings,
            sections that do not sum to rotary_dim / 2.
    """

    head_dim: int
    rotary_dim: int | None = None
    base: float = 10000.0
    scaling: Scaling = field(default_factory=Default)
    pairing: str = "split_half"
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    softmax_scale_factor: float = 1.0
    direction: int = 1

    # ---------------------------------------------------------------- construction
    def __post_init__(self) -> None:
        head = integer("head_dim", self.head_dim, min=1)
        if self.rotary_dim is None:
            rotary = head
        else:
            rotary = integer("rotary_dim", self.rotary_dim, min=1, max=head, what=f"an integer in [2, head_dim={head}]")
        if rotary % 2:
            arg = "rotary_dim" if self.rotary_dim is not None else "head_dim"  # rotary_dim defaults to head_dim
            fail(arg, "an even number of channels (rotation pairs)", rotary)
        object.__setattr__(self, "head_dim", head)
        object.__setattr__(self, "rotary_dim", rotary)
        object.__setattr__(self, "base", check_base(self.base))
        if not hasattr(self.scaling, "inv_freq"):
            fail("scaling", "a scaling rule from posenc.rope.scaling", self.scaling)
        choice("pairing", self.pairing, PAIRINGS)
        object.__setattr__(self, "mrope_interleaved", boolean("mrope_interleaved", self.mrope_interleaved))
        if self.mrope_section is not None:
            section = check_sections(self.mrope_section)
            mrope_axis_map(section, self.mrope_interleaved)  # interleaved M-RoPE needs exactly 3 sections
            if sum(section) != rotary // 2:
                fail("mrope_section", f"sections summing to rotary_dim / 2 = {rotary // 2}", list(section))
            object.__setattr__(self, "mrope_section", section)
        object.__setattr__(self, "softmax_scale_factor", real("softmax_scale_factor", self.softmax_scale_factor, gt=0))
        if type(self.direction) is not int or self.direction not in (1, -1):  # not True, not -1.0
            fail("direction", "1 or -1 (the sign of the rotation angle)", self.direction)
        # Fail at construction, not at first use, if the scaling cannot serve this width.
        with torch.device("cpu"):  # a value's own tensor, also when made under a meta or cuda default device
            inv, factor = self.scaling.inv_freq(self.base, rotary, None)  # [r/2] float32
        freq = None if self.scaling.depends_on_length else (inv if self.direction == 1 else -inv)
        # Not dataclass fields (they stay out of fields(), ==, hash and repr): the signed ladder and its
        # attention factor, and the C kernel's pairing code when a call without a table may take the decode
        # path (the ladder is kept, the kernel holds these rows, and cos_sin is this class's own).
        object.__setattr__(self, "_freq", freq)
        object.__setattr__(self, "_factor", factor)
        fast = freq is not None and fits(rotary, head) and type(self).cos_sin is Rope.cos_sin
        object.__setattr__(self, "_code", PAIRING_CODES[self.pairing] if fast else None)

    @classmethod
    def from_hf_config(cls, config: Any, *, layer_type: str | None = None) -> "Rope":
        """Build from a transformers `config.json` dict or a `PretrainedConfig` (4.x and 5.x keys).

        Args:
            config: the model config.
            layer_type: for models with per-layer RoPE (Gemma 3: "sliding_attention" / "full_attention").
        Raises:
            PosencError: unknown model or rope type, missing or foreign keys, invalid values.
        """
        from ..hf import rope_from_hf_config

        return rope_from_hf_config(config, layer_type=layer_type)

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

    def _ladder(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        """`angle_freq(seq_len)`, the kept ladder where the scaling does not depend on the length (not to be
        changed in place: internal callers only)."""
        return (self._freq, self._factor) if self._freq is not None else self.angle_freq(seq_len)

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
        freq = self._freq
        if (type(position_ids) is Tensor and position_ids.dtype is _INT64 and 1 <= position_ids.ndim <= 2
                and seq_len is None and precision == "float32" and freq is not None and not position_ids.is_meta):
            out = cos_sin_fresh(position_ids, freq, self._factor, allow_negative)  # a few CPU positions: C
            if out is not None:
                return out  # [..., r/2] each
            check_position_values(position_ids, allow_negative)  # the common call: int64 [t] or [b, t] positions
            if not position_ids.is_cpu:
                freq = freq.to(position_ids.device)
            return tables.float32_cos_sin(position_ids, freq, self._factor)  # [..., r/2]
        position_ids = positions("position_ids", position_ids, shapes=[("t",), ("b", "t"), (3, "b", "t")],
                                 allow_negative=allow_negative,
                                 negative_hint="(pass allow_negative=True to rotate backwards)")
        multi_axis = position_ids.ndim == 3
        if multi_axis and (self.mrope_section is None or position_ids.shape[0] != 3):
            expected = "[3, b, t] positions" if self.mrope_section else "[t] or [b, t] (this Rope has no mrope_section)"
            fail("position_ids", expected, position_ids)
        tables.check_precision(precision)
        inv, factor = self._ladder(self.seq_len_for(position_ids, seq_len))
        if multi_axis:  # [b, t, r/2], each frequency from the axis that drives it
            return mrope_cos_sin(position_ids, inv, self.mrope_section, interleaved=self.mrope_interleaved,
                                 attention_factor=factor, precision=precision)
        if precision == "float32":
            return tables.float32_cos_sin(position_ids, inv.to(position_ids.device), factor)  # [..., r/2]
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

    # ---------------------------------------------------------------- rotation
    def rotate(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        layout: str = "bhtd",
        seq_len: int | None = None,
        precision: str = "float32",
        allow_negative: bool = False,
        compute_dtype: torch.dtype | None = None,
        impl: str | None = None,
        table: RopeTable | None = None,
    ) -> torch.Tensor:
        """Rotate one tensor (q or k) at `position_ids`. See `apply` for the arguments."""
        check_x(self.head_dim, "x", x, layout)
        position_ids = check_positions(position_ids, x, layout, "x")
        cos, sin, rows = self._tables_for(position_ids, table, seq_len, precision, allow_negative, x)
        return dispatch.rotate(x, None, cos, sin, rows, self.pairing, impl=impl, layout=layout,
                               compute_dtype=compute_dtype)[0]

    def apply(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        layout: str = "bhtd",
        seq_len: int | None = None,
        precision: str = "float32",
        allow_negative: bool = False,
        compute_dtype: torch.dtype | None = None,
        impl: str | None = None,
        table: RopeTable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k at explicit logical positions (new tensors; `apply_` rotates in place).

        Args:
            q: `[b, hq, t, d]` (layout "bhtd"), `[b, t, hq, d]` ("bthd") or packed `[t, hq, d]` ("thd").
            k: the same with `hk` heads (GQA: hk may differ from hq).
            position_ids: `[t]`, `[b, t]`, or `[3, b, t]` for multi-axis RoPE; integer logical positions.
            layout: "bhtd", "bthd" or "thd".
            seq_len: length for length-dependent scalings (default `max(position_ids) + 1`, as transformers).
            precision: "float32" or "exact".
            allow_negative: accept negative positions.
            compute_dtype: the rotation's dtype (default float32, one rounding; `q.dtype` reproduces
                transformers' bf16/fp16 arithmetic bit for bit, see `apply_rope`).
            impl: "reference", "cpu", "compiled" or "triton" (see `posenc.kernels`); default None = the
                fastest available for q's device, bit-identical to the reference. A named impl never falls
                back: it raises PosencError when it cannot run these inputs.
            table: a `RopeTable` of this Rope (`rope.table(n)`), read at row p for position p: the fast
                path for repeated calls (decode). Without it the call computes the rows its positions need.
        Returns:
            `(q_rotated, k_rotated)` in the inputs' dtypes; pass-through channels bit-identical.
        Raises:
            PosencError: non-float q/k, wrong head_dim, mismatched shapes, non-integer or negative positions,
                an impl that cannot run here, a table of another Rope or positions outside it.
        """
        if table is None:
            if (self._code is not None and seq_len is None and compute_dtype is None and (impl is None or impl == "cpu")
                    and precision == "float32" and type(position_ids) is Tensor and position_ids.dtype is _INT64
                    and 1 <= position_ids.ndim <= 2 and position_ids.is_cpu and not _compiling()):  # no table, CPU
                out = rotate_fresh(q, k, position_ids, self, layout, allow_negative, False)
                if out is not None:
                    return out
        elif (type(table) is RopeTable and table.held is not None and table.rope is self and seq_len is None
                and compute_dtype is None and (impl is None or impl == "cpu") and precision == table.precision
                and not _compiling()):  # the decode hot path (None: a call for the general path)
            out = rotate_held(q, k, position_ids, table.held, layout, self.head_dim, False)
            if out is not None:
                return out
        return self._apply(q, k, position_ids, False, layout, seq_len, precision, allow_negative, compute_dtype, impl, table)

    # apply's keywords, spelled out (a **options dict would cost ~0.3 us per decode call)
    def apply_(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, *, layout: str = "bhtd",
               seq_len: int | None = None, precision: str = "float32", allow_negative: bool = False,
               compute_dtype: torch.dtype | None = None, impl: str | None = None,
               table: RopeTable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k in place; returns `(q, k)`.

        Like a torch in-place op: a tensor autograd saved for backward makes that backward raise after it.
        The default CPU path rewrites each element once, with no temporary (docs/performance.md).

        Args:
            q, k, position_ids: as `apply`.
            layout, seq_len, precision, allow_negative, compute_dtype, impl, table: as `apply`.
        Returns:
            `(q, k)`, rotated.
        Raises:
            PosencError: as `apply`; also q and k that share memory, or a leaf tensor that requires grad.
        """
        if table is None:
            if (self._code is not None and seq_len is None and compute_dtype is None and (impl is None or impl == "cpu")
                    and precision == "float32" and type(position_ids) is Tensor and position_ids.dtype is _INT64
                    and 1 <= position_ids.ndim <= 2 and position_ids.is_cpu and not _compiling()):  # as in apply
                out = rotate_fresh(q, k, position_ids, self, layout, allow_negative, True)
                if out is not None:
                    return out
        elif (type(table) is RopeTable and table.held is not None and table.rope is self and seq_len is None
                and compute_dtype is None and (impl is None or impl == "cpu") and precision == table.precision
                and not _compiling()):  # the decode hot path, as in apply
            out = rotate_held(q, k, position_ids, table.held, layout, self.head_dim, True)
            if out is not None:
                return out
        return self._apply(q, k, position_ids, True, layout, seq_len, precision, allow_negative, compute_dtype, impl, table)

    def _apply(self, q, k, position_ids, inplace, layout, seq_len, precision, allow_negative, compute_dtype, impl, table):
        # apply and apply_ pass every argument by position: keyword passing is a visible share of a decode call
        check_x(self.head_dim, "q", q, layout)  # metadata only: values are checked in the kernel (no host sync)
        check_x(self.head_dim, "k", k, layout)
        check_pair(q, k, layout, inplace)
        position_ids = check_positions(position_ids, q, layout, "q")
        cos, sin, rows = self._tables_for(position_ids, table, seq_len, precision, allow_negative, q)
        return dispatch.rotate(q, k, cos, sin, rows, self.pairing, inplace=inplace, impl=impl, layout=layout,
                               compute_dtype=compute_dtype)

    def _tables_for(self, position_ids, table, seq_len, precision, allow_negative, x):
        """`(cos, sin, rows)` for `dispatch.rotate`: a held table and the positions as its rows, or per-token tables."""
        if table is None:
            cos, sin = self.cos_sin(position_ids, seq_len=seq_len, precision=precision, allow_negative=allow_negative)
            return cos, sin, None  # [t, r/2] or [b, t, r/2]
        if not isinstance(table, RopeTable):
            fail("table", "a RopeTable (rope.table(n)) or None", table)
        table.check_for(self, seq_len, precision, x)
        if position_ids.ndim == 3:  # M-RoPE: each frequency from the row of the axis that drives it
            if self.mrope_section is None or position_ids.shape[0] != 3:
                fail("position_ids", "[t] or [b, t] (this Rope has no mrope_section)", position_ids)
            dispatch.check_rows(position_ids, table.rows, "position_ids")
            axis = mrope_axis_map(self.mrope_section, self.mrope_interleaved).to(x.device)  # [r/2]
            pick = position_ids[axis].permute(1, 2, 0)  # [b, t, r/2]: the position of each frequency
            column = torch.arange(axis.shape[0], device=x.device)  # [r/2]
            return table.cos[pick, column], table.sin[pick, column], None  # [b, t, r/2]
        return table.cos, table.sin, position_ids if position_ids.dtype == torch.int64 else position_ids.long()
