"""`RopeChecks`, a base of `Rope`: what a `Rope` checks, its fields at construction and the inputs of each call.

`Rope` (rope/spec.py) is the frozen description and its rotation calls; its frequencies and cos/sin tables
are the other base, `RopeTables` (rope/spec_tables.py). The checks raise through `posenc.errors`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import boolean, check_float_tensor, choice, fail, integer, positions, real
from .apply import LAYOUTS, PAIRINGS
from .mrope import check_sections, mrope_axis_map
from .scaling import check_base

__all__ = ["RopeChecks"]

_RANKS = {"bhtd": 4, "bthd": 4, "thd": 3}  # the layouts q and k may come in, and their ranks


class RopeChecks:
    """The checks of `Rope` (a base class; it reads the fields `Rope` declares and is not used on its own)."""

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
        self.scaling.inv_freq(self.base, rotary, None)

    # ---------------------------------------------------------------- checks
    def _check_x(self, arg: str, x: torch.Tensor, layout: str) -> None:
        rank = _RANKS.get(layout) if type(layout) is str else None
        if (type(x) is torch.Tensor and x.ndim == rank and x.dtype.is_floating_point and x.shape[-1] == self.head_dim
                and x.layout is torch.strided):
            return  # the decode hot path: metadata only, a few hundred nanoseconds
        choice("layout", layout, ("bhtd", "bthd", "thd"))
        check_float_tensor(arg, x, ndim=(LAYOUTS[layout][0],))
        if x.shape[-1] != self.head_dim:
            fail(arg, f"last dim = head_dim = {self.head_dim}", x)

    def _check_positions(self, position_ids: Any, x: torch.Tensor, layout: str, arg: str) -> torch.Tensor:
        """Positions that fit `x` (tokens, batch, device); their values are checked where they are read."""
        t = x.shape[LAYOUTS[layout][1]]
        if (type(position_ids) is torch.Tensor and position_ids.dtype is torch.int64 and position_ids.ndim == 1
                and position_ids.shape[0] == t and (position_ids.is_cpu and x.is_cpu or position_ids.device == x.device)):
            return position_ids  # the decode hot path
        position_ids = positions("position_ids", position_ids, device=x.device, check_values=False)
        if position_ids.ndim == 0 or position_ids.shape[-1] != t:
            fail("position_ids", f"last dim = {t} tokens (as {arg})", position_ids)
        if position_ids.ndim >= 2:
            if layout == "thd":
                fail("position_ids", "shape [t] for the packed 'thd' layout", position_ids)
            b = position_ids.shape[-2]
            if b not in (1, x.shape[0]):
                fail("position_ids", f"batch size 1 or {x.shape[0]} (as {arg})", position_ids)
        return position_ids
