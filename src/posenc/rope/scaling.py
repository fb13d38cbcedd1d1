"""RoPE scaling rules as small frozen values.

Each rule maps the head facts `(base, dim)` and an optional sequence length to
`(inv_freq [dim/2] float32, attention_factor)`. Where transformers defines a rule, the arithmetic below
follows its operation order so the frequencies agree element-wise (bit for bit in practice).

Rules whose frequencies depend on the sequence length (`DynamicNTK`, `LongRoPE`) are pure functions of
the `seq_len` they are given; they never keep state between calls. Callers that omit it get the
transformers convention: `max(position_ids) + 1` (see `Rope.cos_sin`).

    >>> import torch
    >>> from posenc.rope.scaling import Linear, default_inv_freq
    >>> inv, af = Linear(factor=4.0).inv_freq(10000.0, 8)
    >>> bool(torch.equal(inv, default_inv_freq(10000.0, 8) / 4.0)), af
    (True, 1.0)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar, Union

import torch

from ..errors import check_positive, fail

__all__ = [
    "Default",
    "Linear",
    "NTKAware",
    "DynamicNTK",
    "YaRN",
    "LongRoPE",
    "Llama3",
    "Scaling",
    "default_inv_freq",
    "yarn_get_mscale",
]


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """`1 / base**(2i/dim)` for i in [0, dim/2), float32, in transformers' operation order.

    Args:
        base: the RoPE base (theta).
        dim: the rotary width (even).
    Returns:
        `[dim/2]` float32 inverse frequencies.
    Raises:
        PosencError: a base that is not a finite number > 0, or a width that is not a positive even integer.
    """
    _check_head(base, dim)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float32) / dim  # [dim/2]
    return 1.0 / (base**exponent)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


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
        check_positive("factor", self.factor)

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
        check_positive("factor", self.factor)

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        _check_head(base, dim)
        if dim <= 2:
            fail("rotary_dim", "more than 2 channels for NTK-aware scaling", dim)
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
        check_positive("factor", self.factor)
        _check_length("max_position_embeddings", self.max_positions)

    def base_at(self, base: float, dim: int, seq_len: int | None) -> float:
        """The effective base at sequence length `seq_len` (None means `max_positions`).

        Past `max_positions` the grown base is computed in float32 tensor arithmetic, as transformers'
        forward computes it (its length `max(position_ids) + 1` is a tensor there), so the tables match
        the model bit for bit; `ROPE_INIT_FUNCTIONS["dynamic"]` called with a Python int length computes
        it in float64 instead and differs by a few float32 ulps (<= 2.5e-7 relative, measured).
        """
        length = self.max_positions if seq_len is None else max(_check_seq_len(seq_len), self.max_positions)
        if length == self.max_positions:  # the unscaled base, exactly (transformers' init path)
            return base * ((self.factor * length / self.max_positions) - (self.factor - 1)) ** (dim / (dim - 2))
        grown = torch.tensor(length, dtype=torch.int64)  # float32 from here on, as in transformers' forward
        grown = base * ((self.factor * grown / self.max_positions) - (self.factor - 1)) ** (dim / (dim - 2))
        return float(grown)  # a float32 value, exactly representable

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        _check_head(base, dim)
        if dim <= 2:
            fail("rotary_dim", "more than 2 channels for dynamic NTK scaling", dim)
        return default_inv_freq(self.base_at(base, dim, seq_len), dim), 1.0


@dataclass(frozen=True)
class YaRN:
    """YaRN (Peng et al. 2023), with DeepSeek's `mscale` / `mscale_all_dim` attention factor.

    Fast channels (more than `beta_fast` turns within `original_max_positions`) keep their frequency,
    slow channels (fewer than `beta_slow` turns) are divided by `factor`, and a linear ramp joins them.
    cos and sin are multiplied by `attention_factor` (default `0.1 ln(factor) + 1`, or the ratio
    `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are given).
    `truncate=False` keeps the fractional correction range (gpt-oss).
    `beta_fast=None` / `beta_slow=None` mean transformers' defaults, 32 and 1.
    """

    factor: float
    original_max_positions: int
    beta_fast: float | None = 32.0
    beta_slow: float | None = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    name: ClassVar[str] = "yarn"
    depends_on_length: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_positive("factor", self.factor)
        _check_length("original_max_position_embeddings", self.original_max_positions)
        for arg, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
            if getattr(self, arg) is None:  # transformers: `beta_fast or 32`, `beta_slow or 1`
                object.__setattr__(self, arg, default)
            check_positive(arg, getattr(self, arg))
        if self.beta_fast <= self.beta_slow:
            fail("beta_fast", f"a value greater than beta_slow={self.beta_slow}", self.beta_fast)
        for arg in ("mscale", "mscale_all_dim"):
            if getattr(self, arg) is not None:
                check_positive(arg, getattr(self, arg), allow_zero=True)
        if self.attention_factor is not None:
            check_positive("attention_factor", self.attention_factor)
        if not isinstance(self.truncate, bool):
            fail("truncate", "True or False", self.truncate)

    def effective_attention_factor(self) -> float:
        """The multiplier applied to cos and sin."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim))
        return yarn_get_mscale(self.factor)

    def correction_range(self, base: float, dim: int) -> tuple[float, float]:
        """The channel range `(low, high)` over which the ramp goes from extrapolation to interpolation."""

        def correction_dim(turns: float) -> float:
            return (dim * math.log(self.original_max_positions / (turns * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def ramp(self, base: float, dim: int) -> torch.Tensor:
        """`[dim/2]` float32: 0 where the channel keeps its frequency, 1 where it is divided by `factor`."""
        low, high = self.correction_range(base, dim)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        linear = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)
        return torch.clamp(linear, 0, 1)

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`([dim/2] float32, attention factor)`; `seq_len` is ignored (YaRN is static)."""
        _check_head(base, dim)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)  # [dim/2]
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        keep = 1 - self.ramp(base, dim)  # 1: keep the original frequency
        inv = interpolation * (1 - keep) + extrapolation * keep
        return inv, self.effective_attention_factor()

    def softmax_scale_factor(self) -> float:
        """DeepSeek-V2/V3's extra softmax multiplier `mscale(factor, mscale_all_dim)**2` (1 if unset)."""
        if self.mscale_all_dim:
            m = yarn_get_mscale(self.factor, self.mscale_all_dim)
            return m * m
        return 1.0


@dataclass(frozen=True)
class LongRoPE:
    """LongRoPE (Phi-3 family): per-channel divisors, `short_factor` up to `original_max_positions`
    tokens and `long_factor` beyond (`seq_len > original_max_positions`, strict).

    `attention_factor` multiplies cos and sin for both sets; `LongRoPE.default_attention_factor`
    gives the paper's `sqrt(1 + ln(factor) / ln(original_max_positions))`.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_positions: int
    attention_factor: float = 1.0
    name: ClassVar[str] = "longrope"
    depends_on_length: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_length("original_max_position_embeddings", self.original_max_positions)
        check_positive("attention_factor", self.attention_factor)
        for arg in ("short_factor", "long_factor"):
            values = getattr(self, arg)
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                fail(arg, "a list of positive numbers", values)
            object.__setattr__(self, arg, tuple(float(check_positive(f"{arg}[{i}]", v)) for i, v in enumerate(values)))
        if len(self.short_factor) != len(self.long_factor):
            fail("long_factor", f"{len(self.short_factor)} values (as many as short_factor)", len(self.long_factor))

    @staticmethod
    def default_attention_factor(factor: float, original_max_positions: int) -> float:
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(original_max_positions))

    def uses_long(self, seq_len: int | None) -> bool:
        """True iff `seq_len > original_max_positions` (strict; None means the short set, as at init)."""
        return seq_len is not None and _check_seq_len(seq_len) > self.original_max_positions

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`([dim/2] float32, attention factor)` with the short or long divisors chosen by `seq_len`."""
        _check_head(base, dim)
        if len(self.short_factor) != dim // 2:
            fail("short_factor", f"{dim // 2} values (rotary_dim / 2)", len(self.short_factor))
        factors = self.long_factor if self.uses_long(seq_len) else self.short_factor
        ext = torch.tensor(factors, dtype=torch.float32)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (ext * base**shape), float(self.attention_factor)


@dataclass(frozen=True)
class Llama3:
    """Llama-3.1 scaling: wavelengths shorter than `L0/high_freq_factor` untouched, longer than
    `L0/low_freq_factor` divided by `factor`, and a smooth blend between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int
    name: ClassVar[str] = "llama3"
    depends_on_length: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_positive("factor", self.factor)
        check_positive("low_freq_factor", self.low_freq_factor)
        check_positive("high_freq_factor", self.high_freq_factor)
        if self.low_freq_factor >= self.high_freq_factor:
            fail("low_freq_factor", f"a value below high_freq_factor={self.high_freq_factor}", self.low_freq_factor)
        _check_length("original_max_position_embeddings", self.original_max_positions)

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`([dim/2] float32, attention factor 1.0)`; `seq_len` is ignored."""
        inv = default_inv_freq(base, dim)
        low_wavelen = self.original_max_positions / self.low_freq_factor
        high_wavelen = self.original_max_positions / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (self.original_max_positions / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0


def _check_head(base: object, dim: object) -> None:
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not math.isfinite(base) or base <= 0:
        fail("base", "a finite number > 0 (rope_theta)", base)
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim <= 0 or dim % 2:
        fail("rotary_dim", "a positive even number of channels (rotation pairs)", dim)


def _check_seq_len(seq_len: object) -> int:
    if isinstance(seq_len, torch.Tensor) and seq_len.numel() == 1 and not seq_len.dtype.is_floating_point:
        seq_len = int(seq_len)  # transformers passes `max(position_ids) + 1` as a tensor
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 0:
        fail("seq_len", "a non-negative integer (or None)", seq_len)
    return int(seq_len)


def _check_length(arg: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        fail(arg, "a positive integer number of positions", value)


Scaling = Union[Default, Linear, NTKAware, DynamicNTK, YaRN, LongRoPE, Llama3]
SCALINGS: dict[str, type] = {
    cls.name: cls for cls in (Default, Linear, NTKAware, DynamicNTK, YaRN, LongRoPE, Llama3)  # type: ignore[attr-defined]
}
