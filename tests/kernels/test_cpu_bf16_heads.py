"""The CPU kernel's bfloat16 decode rows (`rope_heads.h`, heads of 128 channels, one token at a time).

A step of 32 pairs is rounded by one instruction when its inputs and its token's table row are in the range
where no result can be NaN or denormal (inputs' exponent field in [64, 192), every cos/sin of magnitude in
[2^-31, 2)), else by exact bit arithmetic. Both must equal the reference bit for bit (NaN: as NaN) right at
those bounds, on either side of them, in place and not, in both 4-d layouts.
"""

import pytest
import torch

from posenc import Rope
from posenc.kernels import cpu
from posenc.rope.tables import RopeTable

pytestmark = pytest.mark.skipif(not cpu.available(torch.bfloat16), reason="no C compiler for the cpu kernel")

ROPE = Rope(head_dim=128)
SAFE_EXPONENTS = [64, 65, 66, 120, 127, 128, 190, 191]  # the fast rounding's input range, edges included
UNSAFE_EXPONENTS = [0, 1, 20, 40, 62, 63, 192, 193, 230, 254, 255]  # zero or denormal, tiny, just below,
# just above, huge, inf or NaN


DENORMAL_CASES = {2.0**-63: 2.0**-60, 2.0**-95: 2.0**-31}  # input value: table scale (special_table)


def bf16_from_fields(sign: torch.Tensor, exponent: torch.Tensor, mantissa: torch.Tensor) -> torch.Tensor:
    bits = (sign << 15) | (exponent << 7) | mantissa
    return bits.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 keeps the low 16 bits


def edge_inputs(heads: int, tokens: int, seed: int) -> torch.Tensor:
    """[tokens, heads, 1, 128] bfloat16: most heads entirely in the fast range (at its edges), every third head
    with 8 pairs (both channels) outside it, so that both roundings run side by side in one call and tiny
    pairs make denormal results; the heads after those with one NaN (with a payload) at a random channel."""
    g = torch.Generator().manual_seed(seed)
    n = tokens * heads * 128
    exps = torch.tensor(SAFE_EXPONENTS)[torch.randint(0, len(SAFE_EXPONENTS), (n,), generator=g)]
    x = bf16_from_fields(torch.randint(0, 2, (n,), generator=g), exps, torch.randint(0, 128, (n,), generator=g))
    x = x.reshape(tokens, heads, 1, 128).clone()
    for t in range(tokens):
        for h in range(0, heads, 3):
            pairs = torch.randperm(64, generator=g)[:8]
            for j in (pairs, pairs + 64):
                e = torch.tensor(UNSAFE_EXPONENTS)[torch.randint(0, len(UNSAFE_EXPONENTS), (8,), generator=g)]
                sign, m = torch.randint(0, 2, (8,), generator=g), torch.randint(0, 128, (8,), generator=g)
                x[t, h, 0, j] = bf16_from_fields(sign, e, m)
        for h in range(1, heads, 3):  # one NaN anywhere: every input of a head counts
            m = torch.randint(1, 128, (), generator=g)
            x[t, h, 0, torch.randint(0, 128, (), generator=g)] = bf16_from_fields(torch.tensor(0), torch.tensor(255), m)
    return x


def special_table() -> RopeTable:
    """Rows 0-4095 of the real table, then rows whose cos/sin sit at or just past the row bound."""
    base = ROPE.table(4096)
    cos, sin = base.cos.clone(), base.sin.clone()
    extra = []
    for value in (2.0**-31, -(2.0**-31), 2.0 - 2.0**-22, -(2.0 - 2.0**-22),  # in range, at its edges
                  2.0**-31 * (1 - 2.0**-24), 2.0, 0.0, float("inf"), float("nan"), 1e-40):  # out of range
        c, s = cos[4095].clone(), sin[4095].clone()
        c[17], s[40] = value, -value
        extra.append((c, s))
    # two rows that make results denormal (float32 denormals, nonzero bfloat16 ones, which the one-instruction
    # rounding would flush to 0), with inputs a = b = DENORMAL_CASES[row]: outside the row range, inputs inside
    # theirs (2^-60 (1 + 2^-7) 2^-63 - 2^-60 2^-63 = 2^-130), then inside the row range, inputs outside
    # theirs (exponent field 32: 2^-31 (1 + 2^-7) 2^-95 - 2^-31 2^-95 = 2^-133; in every 4th channel only, the
    # other channels 1.0, so that one misread word of each 4 in the input test shows)
    for scale in DENORMAL_CASES.values():
        extra.append((torch.full((64,), scale * (1 + 2.0**-7)), torch.full((64,), scale)))
    cos = torch.cat([cos, torch.stack([c for c, _ in extra])])
    sin = torch.cat([sin, torch.stack([s for _, s in extra])])
    return RopeTable(ROPE, cos, sin, None, "float32")


def assert_bits_equal(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    nan = expected.isnan()  # torch's own conversions give NaN as 0x7fc0 or 0xffff: compare NaN as NaN
    assert torch.equal(got.isnan(), nan), what
    assert (got.view(torch.int16)[nan] == 0x7FC0).all(), what  # the kernel's NaN is c10::BFloat16's
    diff = got.view(torch.int16)[~nan] != expected.view(torch.int16)[~nan]
    assert not diff.any(), f"{what}: {int(diff.sum())} elements differ"


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_bf16_decode_heads_equal_reference_at_the_fast_rounding_bounds(layout):
    table = special_table()
    rows = torch.arange(table.rows)
    picked = torch.cat([torch.tensor([0, 1, 7, 4095]), rows[4096:]])  # position 0: zero sines (row refused)
    tokens = picked.numel()
    q, k = edge_inputs(32, tokens, seed=1), edge_inputs(8, tokens, seed=2)
    denormal_rows = range(tokens - len(DENORMAL_CASES), tokens)  # the last rows: their token's first k head
    for row, value in zip(denormal_rows, DENORMAL_CASES):
        k[row, 0] = 1.0
        k[row, 0, ..., ::4] = value
    if layout == "bthd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    pos = picked[:, None]  # [b, 1]: one token per batch row
    expected = ROPE.apply(q, k, pos, layout=layout, impl="reference", table=table)
    for row in denormal_rows:  # the cases are what they say: a*cos - b*sin is denormal, not 0
        head0 = (expected[1][row, 0] if layout == "bhtd" else expected[1][row, :, 0])[..., :64:4]
        assert ((head0.view(torch.int16) & 0x7F80) == 0).all() and (head0 != 0).all(), row
    bits = q.view(torch.int16).clone(), k.view(torch.int16).clone()
    qi, ki = q.clone(), k.clone()
    for name, got in (("apply", ROPE.apply(q, k, pos, layout=layout, table=table)),
                      ("apply_", ROPE.apply_(qi, ki, pos, layout=layout, table=table))):
        for arg, g, e in zip("qk", got, expected):
            assert_bits_equal(g, e, f"{name} {arg}")
    assert torch.equal(q.view(torch.int16), bits[0]) and torch.equal(k.view(torch.int16), bits[1])


def test_bf16_decode_heads_equal_reference_on_every_input_pattern():
    # every bfloat16 bit pattern once as a and once as b of some pair, at ordinary positions
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    q = patterns.reshape(16, 32, 1, 128)  # 16 tokens of 32 heads
    k = patterns.flip(0).reshape(16, 32, 1, 128).contiguous()
    pos = torch.tensor([0, 1, 2, 3, 100, 511, 512, 1000, 2047, 2048, 3000, 4000, 4093, 4094, 4095, 9])[:, None]
    table = ROPE.table(4096)
    expected = ROPE.apply(q, k, pos, impl="reference")
    qi, ki = q.clone(), k.clone()
    for name, got in (("apply", ROPE.apply(q, k, pos, table=table)), ("apply_", ROPE.apply_(qi, ki, pos, table=table))):
        for arg, g, e in zip("qk", got, expected):
            assert_bits_equal(g, e, f"{name} {arg}")
