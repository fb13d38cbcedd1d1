"""posenc.cache.quant.formats: every element within the format's bound, the bound within a float64 closed form."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import posenc
from posenc.cache.quant.formats import FORMATS, bytes_per_vector, decode, encode, error_bound, kv_format

SCALED = ("int8", "int4", "fp8")


def closed_form(x: torch.Tensor, fmt: str, axis: str) -> torch.Tensor:
    """float64 bound from the block's own range, independent of the codec's stored statistics."""
    x = x.double()
    dim = -1 if axis == "token" else -2
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    if fmt in ("int8", "int4"):
        levels = 2 ** FORMATS[fmt].bits - 1
        width = (hi - lo) + 2.0**-10 * lo.abs() + 2.0**-24  # the offset rounded down to float16
        step = width / levels * (1 + 2.0**-10) + 2.0**-24  # the scale rounded up to float16
        return (step / 2 * (1 + 2.0**-11) + 2.0**-21 * (lo.abs() + width)).expand_as(x)
    if fmt == "fp8":
        scale = x.abs().amax(dim, keepdim=True) / 448 * (1 + 2.0**-10) + 2.0**-24
        return torch.maximum(x.abs() * 2.0**-4, 2.0**-10 * scale) * (1 + 2.0**-15) + 2.0**-21 * x.abs()
    mantissa = {"float32": 23, "bfloat16": 7, "float16": 10}[fmt]
    return x.abs() * 2.0 ** -(mantissa + 1) + 2.0**-24


def check_roundtrip(x: torch.Tensor, fmt: str, axis: str) -> None:
    enc = encode(x, fmt, axis)
    err = (decode(enc).double() - x.double()).abs()
    bound = error_bound(x, enc)
    assert bound.shape == x.shape
    assert bool((err <= bound.double()).all()), f"{fmt}/{axis}: error {float((err - bound).max())} above bound"
    assert bool((bound.double() <= closed_form(x, fmt, axis)).all()), f"{fmt}/{axis}: bound looser than closed form"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("shape", [(2, 3, 16, 64), (3, 5, 7, 10), (1, 1, 1, 2)])
def test_roundtrip_within_bound(fmt, axis, shape, gen):
    x = torch.randn(shape, generator=gen) * 3 + 0.5
    check_roundtrip(x, fmt, axis)


@pytest.mark.parametrize("fmt", SCALED)
def test_outlier_channels_per_channel_keeps_normal_channels_tight(fmt, gen):
    """A channel 100x larger than the rest: per channel, the other channels keep their own small steps
    (int; fp8 is relative, so an outlier costs the small channels only its subnormal floor)."""
    x = torch.randn(1, 2, 32, 16, generator=gen)
    x[..., 3] = x[..., 3] * 100 + 40
    check_roundtrip(x, fmt, "channel")
    check_roundtrip(x, fmt, "token")
    normal = [c for c in range(16) if c != 3]
    per_channel = (decode(encode(x, fmt, "channel")) - x)[..., normal].abs().max()
    per_token = (decode(encode(x, fmt, "token")) - x)[..., normal].abs().max()
    assert per_channel < per_token / (4 if fmt != "fp8" else 1)


def test_int4_codes_pack_two_channels_per_byte():
    x = torch.tensor([[0.0, 15.0, 15.0, 0.0], [15.0, 0.0, 0.0, 15.0]])  # per channel: offset 0, step 1
    enc = encode(x, "int4", "channel")
    assert enc.codes.shape == (2, 2) and enc.codes.dtype == torch.uint8
    low, high = enc.codes.long() % 16, enc.codes.long() // 16  # independent unpack: arithmetic, not bit ops
    assert low.tolist() == [[0, 15], [15, 0]] and high.tolist() == [[15, 0], [0, 15]]
    torch.testing.assert_close(decode(enc), x, atol=0, rtol=0)


@pytest.mark.parametrize("fmt,value", [(f, v) for f in ("int8", "int4") for v in (0.0, -2.5, 7.0)]
                         + [("fp8", 0.0), ("fp8", 7.0)])  # fp8: 7/448 is a power of two, so 7 is exact
def test_constant_and_zero_blocks_are_exact(fmt, value):
    x = torch.full((3, 4), value)
    for axis in ("token", "channel"):
        assert torch.equal(decode(encode(x, fmt, axis)), x), (fmt, value, axis)


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(list(FORMATS)), axis=st.sampled_from(["token", "channel"]),
       t=st.integers(1, 9), half_d=st.integers(1, 6), log_scale=st.floats(-12, 12), shift=st.floats(-1e3, 1e3),
       seed=st.integers(0, 2**16))
def test_fuzz_roundtrip(fmt, axis, t, half_d, log_scale, shift, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, t, 2 * half_d, generator=g) * 2.0**log_scale + shift
    check_roundtrip(x, fmt, axis)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bytes_per_vector_counts_codes_and_stats(fmt, gen):
    x = torch.randn(4, 8, 64, generator=gen)  # [heads, tokens=group, d]
    for axis in ("token", "channel"):
        enc = encode(x, fmt, axis)
        real = sum(t.numel() * t.element_size() for t in enc[:3] if t is not None)
        assert bytes_per_vector(fmt, 64, axis, group=8) * 4 * 8 == real


def test_refusals_name_the_argument():
    with pytest.raises(posenc.PosencError, match="kv_dtype"):
        kv_format("int3")
    with pytest.raises(posenc.PosencError, match="x: expected an even number of channels"):
        encode(torch.zeros(2, 5), "int4")
    with pytest.raises(posenc.PosencError, match="65504"):
        encode(torch.tensor([[1e5, 0.0]]), "int8")
    with pytest.raises(posenc.PosencError, match="65504"):
        encode(torch.tensor([[float("nan"), 0.0]]), "fp8", "channel")
    with pytest.raises(posenc.PosencError, match="axis"):
        encode(torch.zeros(2, 4), "int8", "head")
    assert kv_format("bf16").name == "bfloat16" and kv_format("e4m3").name == "fp8"
