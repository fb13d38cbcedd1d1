"""The unscaled frequency ladder, the scaling rules that treat every frequency alike, and the checks all rules share.

`default_inv_freq` is the ladder `1 / base**(2i/dim)`; `Default` keeps it, `Linear` divides every frequency by
one factor, `NTKAware` and `DynamicNTK` grow the base. The rules that treat each channel by its wavelength
(`YaRN`, `LongRoPE`, `Llama3`), the `Scaling` union and the public import path of everything here are in
rope/scaling.py (`from posenc.rope.scaling import Linear, default_inv_freq`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...errors import fail, integer, real

__all__ = ["Default", "Linear", "NTKAware", "DynamicNTK", "check_base", "check_seq_len", "default_inv_freq"]


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """`1 / base**(2i/dim)` for i in [0, dim/2), float32, in transformers' operation order.

    Args:
        base: the RoPE base (theta).
        dim: the rotary width (even).
    Returns:
        `[dim/2]` float32 inverse frequencies.
    Raises:
        PosencError: a base that is not a finite number > 0 and != 1, or a width that is not a positive even integer.
    """
    base, dim = check_base(base), _check_dim(dim)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float32) / dim  # [dim/2]
    return 1.0 / (base**exponent)


@dataclass(frozen=True)
class Default:
    """Unscaled RoPE."""

    name: ClassVar[str] = "default"
    depends_on_length: ClassVar[bool] = False

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`([dim/2] float32 inverse frequencies, attention factor 1.0)`; `seq_len` is ignored."""
        return default_inv_freq(base, dim), 1.0


@dataclass(frozen=True)
class Linear:
    """Position interpolation (PI, Chen et al. 2023): every frequency divided by `factor`."""

    factor: float
    name: ClassVar[str] = "linear"
    depends_on_length: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _set(self, "factor", real("factor", self.factor, gt=0))

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`([dim/2] float32, attention factor 1.0)`; `seq_len` is ignored."""
        inv = default_inv_freq(base, dim)
        inv /= self.factor
        return inv, 1.0


@dataclass(frozen=True)
class NTKAware:
    """Static NTK-aware scaling: the base becomes `base * factor**(dim / (dim - 2))`."""

    factor: float
    name: ClassVar[str] = "ntk"
    depends_on_length: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _set(self, "factor", real("factor", self.factor, gt=0))

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        base, dim = check_base(base), _check_dim(dim, minimum=4, why="NTK-aware scaling")
        return default_inv_freq(base * self.factor ** (dim / (dim - 2)), dim), 1.0


@dataclass(frozen=True)
class DynamicNTK:
    """Dynamic NTK (transformers' `dynamic`): the base grows with the sequence length past `max_positions`.

    `base' = base * (factor * L / max_positions - (factor - 1)) ** (dim / (dim - 2))` with
    `L = max(seq_len, max_positions)`; at or below `max_positions` this is the unscaled table.
    """

    factor: float
    max_positions: int
    name: ClassVar[str] = "dynamic"
    depends_on_length: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _set(self, "factor", real("factor", self.factor, gt=0))
        _set(self, "max_positions", integer("max_position_embeddings", self.max_positions, min=1))

    def base_at(self, base: float, dim: int, seq_len: int | None) -> float:
        """The effective base at sequence length `seq_len` (None means `max_positions`).

        Past `max_positions` the grown base is computed in float32 tensor arithmetic, as transformers'
        forward computes it (its length `max(position_ids) + 1` is a tensor there), so the tables match
        the model bit for bit; `ROPE_INIT_FUNCTIONS["dynamic"]` called with a Python int length computes
        it in float64 instead and differs by a few float32 ulps (<= 2.5e-7 relative, measured).
        """
        length = self.max_positions if seq_len is None else max(check_seq_len(seq_len), self.max_positions)
        if length == self.max_positions:  # the unscaled base, exactly (transformers' init path)
            return base * ((self.factor * length / self.max_positions) - (self.factor - 1)) ** (dim / (dim - 2))
        grown = torch.tensor(length, dtype=torch.int64)  # float32 from here on, as in transformers' forward
        grown = base * ((self.factor * grown / self.max_positions) - (self.factor - 1)) ** (dim / (dim - 2))
        return float(grown)  # a float32 value, exactly representable

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        base, dim = check_base(base), _check_dim(dim, minimum=4, why="dynamic NTK scaling")
        return default_inv_freq(self.base_at(base, dim, seq_len), dim), 1.0



def check_base(base: object) -> float:
    """The one check of a frequency base (RoPE's theta, a sinusoidal table's 10000): finite, > 0 and != 1."""
    value = real("base", base, gt=0, what="a finite number > 0 and != 1")
    if value == 1.0:  # every frequency would be 1: no position information
        fail("base", "a finite number > 0 and != 1", base)
    return value


def check_seq_len(seq_len: object) -> int:
    """A sequence length for a length-dependent scaling: an integer >= 0 (a 1-element integer tensor too)."""
    if isinstance(seq_len, torch.Tensor) and seq_len.numel() == 1 and not seq_len.dtype.is_floating_point \
            and seq_len.dtype != torch.bool:
        seq_len = int(seq_len)  # transformers passes `max(position_ids) + 1` as a tensor
    return integer("seq_len", seq_len, min=0, what="a non-negative integer")


def _check_dim(dim: object, *, minimum: int = 2, why: str = "") -> int:
    what = "a positive even number of channels (rotation pairs)"
    value = integer("rotary_dim", dim, min=1, what=what)
    if value % 2:
        fail("rotary_dim", what, dim)
    if value < minimum:
        fail("rotary_dim", f"more than {minimum - 2} channels for {why}", dim)
    return value


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclass: store the checked, normalised value

