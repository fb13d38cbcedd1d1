"""Quantized key/value formats: pure functions that encode a block of vectors and decode it back.

A block `x [..., t, d]` (t tokens of d channels) is quantized along one axis:
- `axis="token"`: one scale per token, over its d channels (stats `[..., t, 1]`): post-RoPE keys and values.
- `axis="channel"`: one scale per channel, over the block's t tokens (stats `[..., 1, d]`): pre-RoPE keys,
  whose outliers sit in fixed channels (KVQuant, arXiv 2401.18079), so a per-channel range fits them.

Formats (`FORMATS`; `kv_format` also takes the short names fp32, bf16, fp16, e4m3):
- "float32", "bfloat16", "float16": a plain cast, no scales.
- "int8", "int4": asymmetric uniform codes 0..2**bits-1, `x ~ code * scale + offset`; int4 packs two
  channels per byte (even channel in the low nibble), so d must be even.
- "fp8": float8 e4m3 (torch.float8_e4m3fn, max 448) of `x / scale`, symmetric.

Scales and offsets are float16 (2 bytes each), rounded outward: the offset down and the scale up, so every
input lands inside the code range without a clamp; inputs beyond float16's range are refused. The error of
every element is at most `error_bound(x, encoded)`: half a step for int formats, half an ulp of the target
for the float ones (relative), plus float32 rounding of the decode.

    >>> import torch
    >>> x = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    >>> enc = encode(x, "int8", "channel")
    >>> bool(((decode(enc) - x).abs() <= error_bound(x, enc)).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...errors import Raw, assert_values, check_float_tensor, fail

__all__ = ["KVFormat", "FORMATS", "AXES", "Encoded", "kv_format", "encode", "decode", "error_bound",
           "bytes_per_vector"]

AXES = ("token", "channel")
STAT_BYTES = 2  # float16 scale / offset
HALF_MAX = 65504.0  # float16's largest finite value: scales and offsets must fit it
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value


@dataclass(frozen=True)
class KVFormat:
    """A storage format: `kind` "cast" (a float dtype), "int" (asymmetric codes) or "fp8" (scaled e4m3)."""

    name: str
    kind: str
    bits: int
    storage: torch.dtype

    @property
    def stats(self) -> int:
        """Float16 statistics per scaled group: scale and offset (int), scale (fp8), none (cast)."""
        return {"cast": 0, "int": 2, "fp8": 1}[self.kind]


FORMATS = {f.name: f for f in (
    KVFormat("float32", "cast", 32, torch.float32), KVFormat("bfloat16", "cast", 16, torch.bfloat16),
    KVFormat("float16", "cast", 16, torch.float16), KVFormat("int8", "int", 8, torch.uint8),
    KVFormat("int4", "int", 4, torch.uint8), KVFormat("fp8", "fp8", 8, torch.float8_e4m3fn))}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "e4m3": "fp8", "float8_e4m3": "fp8"}
_MANTISSA = {"float32": 23, "bfloat16": 7, "float16": 10, "fp8": 3}
_TINY = {"float32": 2.0**-149, "bfloat16": 2.0**-133, "float16": 2.0**-24, "fp8": 2.0**-9}  # smallest subnormal


class Encoded(NamedTuple):
    """An encoded block: `codes` (storage dtype; int4: `[..., d/2]` uint8), float16 `scale` and `offset`
    (None where the format has none), the `format` name and the `axis`."""

    codes: torch.Tensor
    scale: torch.Tensor | None
    offset: torch.Tensor | None
    format: str
    axis: str


def kv_format(name: object, *, arg: str = "kv_dtype") -> KVFormat:
    """The format called `name` (a key of FORMATS or a short name); PosencError naming `arg` otherwise."""
    if isinstance(name, str) and ALIASES.get(name, name) in FORMATS:
        return FORMATS[ALIASES.get(name, name)]
    fail(arg, f"one of {tuple(FORMATS)} (or {tuple(ALIASES)})", name)


def check_block(x: object, fmt: KVFormat, arg: str) -> torch.Tensor:
    """Refuse what the format cannot hold: non-float, odd d for int4, non-finite or beyond float16's range.

    The range is checked on the device (`errors.assert_values`, no host sync): on the CPU in eager mode a
    failure raises PosencError at once; on an accelerator it surfaces at the next synchronisation.
    """
    x = check_float_tensor(arg, x)
    if x.ndim < 2:
        fail(arg, "a tensor [..., t, d] of rank >= 2", x)
    if fmt.name == "int4" and x.shape[-1] % 2:
        fail(arg, "an even number of channels d (int4 packs two channels per byte)", Raw(f"d={x.shape[-1]}"))
    if fmt.kind != "cast" or fmt.name == "float16":
        big = x.detach().abs().amax() if x.numel() else x.new_zeros(())
        assert_values(arg, big <= HALF_MAX, f"finite values within +-{HALF_MAX:g} ({fmt.name} keeps float16 "
                      "scales)", lambda: Raw(f"max |x| {float(big):.4g}"))  # NaN fails too; on the device
    return x


def _outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 -> float16 rounded toward +inf (`up`) or -inf, so the stored statistic never shrinks the range."""
    h = x.to(torch.float16)
    worse = h.float() < x if up else h.float() > x
    return torch.where(worse, torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf"))), h)


def encode(x: torch.Tensor, fmt: str | KVFormat, axis: str = "token", *, arg: str = "x") -> Encoded:
    """Quantize a block along `axis`.

    Args:
        x: `[..., t, d]` floating point (computed in float32).
        fmt: a format name or KVFormat.
        axis: "token" (stats `[..., t, 1]`) or "channel" (stats `[..., 1, d]`).
        arg: the name bad input is reported under.
    Returns:
        `Encoded`: codes `[..., t, d]` (`[..., t, d/2]` for int4), float16 scale/offset of the stats' shape.
    Raises:
        PosencError: an unknown format or axis; x not float, odd d for int4, values beyond +-65504 or NaN
            (the range on the device: see `check_block`).
    """
    fmt = fmt if isinstance(fmt, KVFormat) else kv_format(fmt)
    if axis not in AXES:
        fail("axis", f"one of {AXES}", axis)
    x = check_block(x, fmt, arg).detach().float()  # [..., t, d]
    if fmt.kind == "cast":
        return Encoded(x.to(fmt.storage), None, None, fmt.name, axis)
    dim = -1 if axis == "token" else -2
    if fmt.kind == "fp8":
        scale = _outward(x.abs().amax(dim, keepdim=True) / FP8_MAX, up=True)  # [..., t, 1] or [..., 1, d]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any scale is exact
        return Encoded((x / scale.float()).to(fmt.storage), scale, None, fmt.name, axis)
    levels = 2**fmt.bits - 1
    offset = _outward(x.amin(dim, keepdim=True), up=False)  # [..., t, 1] or [..., 1, d]
    scale = _outward((x.amax(dim, keepdim=True) - offset.float()) / levels, up=True)
    step = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = torch.round((x - offset.float()) / step).clamp_(0, levels)  # clamp: float32 rounding only (<=1e-7)
    codes = codes.to(torch.uint8)  # [..., t, d]
    if fmt.bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., t, d/2]
    return Encoded(codes, scale, offset, fmt.name, axis)


def decode(enc: Encoded, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[..., t, d]` values of an `Encoded` block (arithmetic in float32), cast to `dtype`."""
    fmt = FORMATS[enc.format]
    if fmt.kind == "cast":
        return enc.codes.to(dtype)
    if fmt.kind == "fp8":
        return (enc.codes.float() * enc.scale.float()).to(dtype)
    codes = enc.codes
    if fmt.bits == 4:
        codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)  # [..., t, d/2, 2] -> [..., t, d]
    return (codes.float() * enc.scale.float() + enc.offset.float()).to(dtype)


def error_bound(x: torch.Tensor, enc: Encoded) -> torch.Tensor:
    """Elementwise bound on `|x - decode(enc)|` (float32, x's shape) for the block `x` that `enc` encodes.

    int: half a step `scale / 2`; fp8: half an e4m3 ulp of `x / scale` times the scale; casts: half an ulp
    of the target dtype; each plus the float32 rounding of the decode arithmetic.
    """
    fmt = FORMATS[enc.format]
    mag = x.detach().float().abs()  # [..., t, d]
    if fmt.kind == "int":  # encode's float32 steps add < levels * 2**-23 of a code; decode rounds twice
        scale, offset = enc.scale.float(), enc.offset.float()
        span = offset.abs() + (2**fmt.bits - 1) * scale  # largest |term| in the decode arithmetic
        return (scale / 2 * (1 + 2.0**-12) + 2.0**-22 * span + 2.0**-126).expand_as(mag)
    if fmt.kind == "fp8":  # the division rounds once before the cast (2**-24 relative), decode once after
        scale = enc.scale.float()
        half_ulp = torch.maximum(mag * 2.0**-(_MANTISSA["fp8"] + 1), _TINY["fp8"] / 2 * scale)
        return half_ulp * (1 + 2.0**-16) + 2.0**-22 * mag + 2.0**-126
    if fmt.name == "float32":
        return torch.zeros_like(mag)
    return torch.maximum(mag * 2.0**-(_MANTISSA[fmt.name] + 1), torch.full_like(mag, _TINY[fmt.name] / 2))


def bytes_per_vector(fmt: str | KVFormat, dim: int, axis: str = "token", group: int = 1) -> float:
    """Bytes one d-channel vector of one head costs: codes, plus its share of the float16 statistics.

    Args:
        fmt: format. dim: channels d. axis: "token" (one set of stats per vector) or "channel" (d sets
            per block of `group` vectors, shared).
    """
    fmt = fmt if isinstance(fmt, KVFormat) else kv_format(fmt)
    codes = dim * fmt.bits / 8
    if fmt.kind == "cast":
        return codes
    stats = fmt.stats * STAT_BYTES
    return codes + (stats if axis == "token" else stats * dim / group)
