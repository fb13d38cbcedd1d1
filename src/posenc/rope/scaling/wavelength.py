"""The RoPE scaling rules that treat each channel by its wavelength: `YaRN`, `LongRoPE`, `Llama3`.

Each maps `(base, dim)` and an optional sequence length to `(inv_freq [dim/2] float32, attention_factor)`,
following transformers' operation order so the frequencies agree element-wise (bit for bit in practice).

    >>> import torch
    >>> from posenc.rope.scaling import Llama3, default_inv_freq
    >>> inv, af = Llama3(8.0, 1.0, 4.0, 8192).inv_freq(500000.0, 8)
    >>> bool(torch.equal(inv[:1], default_inv_freq(500000.0, 8)[:1])), af   # short wavelengths keep theirs
    (True, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Union

import torch

from ...errors import boolean, fail, integer, real
from .uniform import Default, DynamicNTK, Linear, NTKAware, _check_dim, _set, check_base, check_seq_len, default_inv_freq

__all__ = ["YaRN", "LongRoPE", "Llama3", "Scaling", "yarn_get_mscale"]


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


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
        _set(self, "factor", real("factor", self.factor, gt=0))
        _set(self, "original_max_positions",
             integer("original_max_position_embeddings", self.original_max_positions, min=1))
        for arg, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
            value = getattr(self, arg)  # None: transformers' `beta_fast or 32`, `beta_slow or 1`
            _set(self, arg, default if value is None else real(arg, value, gt=0))
        if self.beta_fast <= self.beta_slow:
            fail("beta_fast", f"a value greater than beta_slow={self.beta_slow}", self.beta_fast)
        for arg in ("mscale", "mscale_all_dim"):
            if getattr(self, arg) is not None:
                _set(self, arg, real(arg, getattr(self, arg), ge=0))
        if self.attention_factor is not None:
            _set(self, "attention_factor", real("attention_factor", self.attention_factor, gt=0))
        _set(self, "truncate", boolean("truncate", self.truncate))

    def effective_attention_factor(self) -> float:
        """The multiplier applied to cos and sin."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim))
        return yarn_get_mscale(self.factor)

    def correction_range(self, base: float, dim: int) -> tuple[float, float]:
        """The channel range `(low, high)` over which the ramp goes from extrapolation to interpolation."""

        def correction_dim(arg: str, turns: float) -> float:
            ratio = self.original_max_positions / (turns * 2 * math.pi)
            if not 0 < ratio < math.inf:  # log(0) or log(inf): a beta too large or too small for float64
                fail(arg, f"a number of turns with 0 < original_max_position_embeddings / (2 pi {arg}) < inf", turns)
            return (dim * math.log(ratio)) / (2 * math.log(base))

        low, high = correction_dim("beta_fast", self.beta_fast), correction_dim("beta_slow", self.beta_slow)
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
        base, dim = check_base(base), _check_dim(dim)
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
        _set(self, "original_max_positions",
             integer("original_max_position_embeddings", self.original_max_positions, min=1))
        _set(self, "attention_factor", real("attention_factor", self.attention_factor, gt=0))
        for arg in ("short_factor", "long_factor"):
            values = getattr(self, arg)
            if isinstance(values, (str, bytes, torch.Tensor)) or not hasattr(values, "__len__"):
                fail(arg, "a list of positive numbers", values)
            _set(self, arg, tuple(real(f"{arg}[{i}]", v, gt=0) for i, v in enumerate(values)))
        if len(self.short_factor) != len(self.long_factor):
            fail("long_factor", f"{len(self.short_factor)} values (as many as short_factor)", len(self.long_factor))

    @staticmethod
    def default_attention_factor(factor: float, original_max_positions: int) -> float:
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(original_max_positions))

    def uses_long(self, seq_len: int | None) -> bool:
        """True iff `seq_len > original_max_positions` (strict; None means the short set, as at init)."""
        return seq_len is not None and check_seq_len(seq_len) > self.original_max_positions

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`([dim/2] float32, attention factor)` with the short or long divisors chosen by `seq_len`."""
        base, dim = check_base(base), _check_dim(dim)
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
        for arg in ("factor", "low_freq_factor", "high_freq_factor"):
            _set(self, arg, real(arg, getattr(self, arg), gt=0))
        if self.low_freq_factor > self.high_freq_factor:  # equal: no blend band (Llama 4 Scout's 1.0, 1.0)
            fail("low_freq_factor", f"a value not above high_freq_factor={self.high_freq_factor}", self.low_freq_factor)
        _set(self, "original_max_positions",
             integer("original_max_position_embeddings", self.original_max_positions, min=1))

    def inv_freq(self, base: float, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """`([dim/2] float32, attention factor 1.0)`; `seq_len` is ignored."""
        inv = default_inv_freq(base, dim)
        low_wavelen = self.original_max_positions / self.low_freq_factor
        high_wavelen = self.original_max_positions / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        if self.low_freq_factor == self.high_freq_factor:  # a step at L0 / low_freq_factor, no blend (transformers
            return scaled, 1.0  # computes 0 / 0 there, used only by a pair exactly at the boundary wavelength)
        smooth = (self.original_max_positions / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0


Scaling = Union[Default, Linear, NTKAware, DynamicNTK, YaRN, LongRoPE, Llama3]
