"""Angle precision at long positions, measured against mpmath, and tables that no dtype cast can reach.

The reference is the exact phase `p * f` of the float32 frequencies f (exact binary fractions, so mpmath
holds the product without rounding), reduced mod 2*pi with a 200-bit pi. Run with `-s` to see the table.
"""

import pytest
import torch
from tests.helpers.tolerances import assert_close
from tests.helpers.oracles import rotate_angles

from posenc import Rope
from posenc.rope import tables
from posenc.rope.scaling import default_inv_freq

mpmath = pytest.importorskip("mpmath")

POSITIONS = [2**16, 2**20, 2**24]
EXACT_BOUND = 5e-16  # documented in posenc.rope.tables for |p| <= 2**24 and inv_freq <= 1
COS_BOUND = 2.0**-25  # final float32 rounding of a value in [-1, 1]


def max_errors(theta: float, p_end: int, d: int = 128, window: int = 33) -> dict[str, float]:
    """Max angle error (rad) of both precisions and max cos/sin error of "exact", over `window` positions."""
    mpmath.mp.prec = 200
    two_pi = 2 * mpmath.pi
    pos = torch.arange(p_end - window + 1, p_end + 1)
    inv = default_inv_freq(theta, d)
    a32, ax = tables.angles(pos, inv, "float32"), tables.angles(pos, inv, "exact")
    cos, sin = tables.cos_sin_from_angles(ax)
    worst = {"float32": 0.0, "exact": 0.0, "exact_cos_sin": 0.0}
    for i, p in enumerate(pos.tolist()):
        for j, f in enumerate(inv.tolist()):
            phase = mpmath.mpf(p) * mpmath.mpf(f)  # exact
            for name, table in (("float32", a32), ("exact", ax)):
                diff = mpmath.mpf(table[i, j].item()) - phase
                diff -= two_pi * mpmath.nint(diff / two_pi)  # compare angles mod 2*pi
                worst[name] = max(worst[name], float(abs(diff)))
            trig = max(abs(mpmath.mpf(cos[i, j].item()) - mpmath.cos(phase)),
                       abs(mpmath.mpf(sin[i, j].item()) - mpmath.sin(phase)))
            worst["exact_cos_sin"] = max(worst["exact_cos_sin"], float(trig))
    return worst


@pytest.mark.parametrize("theta", [1e4, 5e5])
def test_measured_angle_error(theta):
    rows = []
    for p in POSITIONS:
        err = max_errors(theta, p)
        rows.append((p, err))
        assert err["exact"] < EXACT_BOUND, err
        assert err["exact_cos_sin"] <= COS_BOUND * 1.01, err
        # float32 is what it is: half an ulp of the angle, far above the exact path, below |angle| * 2**-24
        assert err["float32"] > 1e3 * err["exact"]
        assert err["float32"] <= p * 2.0**-24
    # and it grows with the position: ~16x per 4 bits of position
    assert rows[0][1]["float32"] < rows[1][1]["float32"] < rows[2][1]["float32"]
    print(f"\ntheta={theta:g}, d=128: p, float32 max angle err, exact max angle err, exact max cos/sin err")
    for p, err in rows:
        print(f"  2**{p.bit_length() - 1}: {err['float32']:.3e}  {err['exact']:.3e}  {err['exact_cos_sin']:.3e}")


def test_exact_limit_is_enforced():
    from posenc import PosencError

    inv = default_inv_freq(1e4, 8)
    tables.angles(torch.tensor([2**29 - 1]), inv, "exact")
    with pytest.raises(PosencError, match=r"position_ids: expected \|position\| < 2\*\*29.*got 536870912"):
        tables.angles(torch.tensor([2**29]), inv, "exact")


def test_exact_matches_float32_at_short_positions():
    rope = Rope(head_dim=64)
    pos = torch.arange(0, 64)
    c32, s32 = rope.cos_sin(pos)
    cx, sx = rope.cos_sin(pos, precision="exact")
    assert_close(cx, c32)
    assert_close(sx, s32)


# ------------------------------------------------------------------------------- no table to cast
class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)
        self.rope = Rope(head_dim=64, base=5e5)


def test_module_cast_cannot_touch_the_tables():
    module = Attention()
    pos = torch.arange(5000, 5100)
    before = module.rope.cos_sin(pos)
    rope_before = module.rope
    module.to(torch.bfloat16)
    assert module.proj.weight.dtype == torch.bfloat16  # the cast happened
    assert module.rope is rope_before and not list(module.buffers())
    after = module.rope.cos_sin(pos)
    assert after[0].dtype == torch.float32
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_bf16_input_uses_float32_angles():
    rope = Rope(head_dim=64, base=1e4)
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5000, 5064)  # bf16 cannot hold these integers (above 256)
    out = rope.rotate(x.bfloat16(), pos)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, rope.rotate(x.bfloat16().float(), pos).bfloat16())
    # against a float64 oracle, within the bf16 tolerance
    inv = default_inv_freq(1e4, 64).double()
    ang = pos.double()[:, None] * inv  # [t, 32]
    ref = rotate_angles(x.bfloat16(), ang)  # [1, 2, 64, 64] float64
    assert_close(out, ref.bfloat16())
    # the hazard this avoids: angles made from bf16 positions are off by whole radians
    bad = pos.bfloat16().double()[:, None] * inv
    assert (bad - ang).abs().max() > 1.0


def test_two_pi_parts_sum_to_two_pi_and_the_first_multiplies_exactly():
    # the Cody-Waite split the reduction (and the Triton kernels) use: parts summing to 2*pi within 1e-31, the
    # first with at most 24 significant bits, so k * part for |k| < 2**29 is exact in float64 (53 bits)
    mpmath.mp.prec = 200
    hi, mid, lo = tables.TWO_PI_PARTS
    assert abs(mpmath.mpf(hi) + mpmath.mpf(mid) + mpmath.mpf(lo) - 2 * mpmath.pi) < 1e-31
    mantissa, _ = mpmath.frexp(mpmath.mpf(hi))
    assert (mantissa * 2**24) == int(mantissa * 2**24)  # 24 significant bits
    assert hi == float(torch.tensor(2 * mpmath.pi, dtype=torch.float64).float())  # float32(2*pi)
    assert mpmath.mpf(mid) == mpmath.mpf(float(2 * mpmath.pi)) - mpmath.mpf(hi)  # float64(2*pi) - hi, exactly
