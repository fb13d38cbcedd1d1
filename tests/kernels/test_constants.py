"""The constants the kernels and `rope` share: codes that name every pairing and dtype once, the row limits
that decide where the C kernel runs, and the three parts of 2*pi the exact phase is reduced with."""

import math

import mpmath
import numpy as np
import pytest
import torch

from posenc import Rope
from posenc.kernels import constants
from posenc.rope.apply import PAIRINGS


def test_codes_name_every_pairing_and_dtype_once():
    assert tuple(constants.PAIRING_CODES) == PAIRINGS
    assert sorted(constants.PAIRING_CODES.values()) == list(range(len(PAIRINGS)))
    assert sorted(constants.DTYPE_CODES.values()) == list(range(4))
    assert set(constants.DTYPE_CODES) == {torch.float32, torch.bfloat16, torch.float16, torch.float64}
    assert sorted(constants.ANGLE_CODES) == ["exact", "float32", "table"]


def test_two_pi_parts_sum_to_two_pi_and_the_first_multiplies_exactly():
    hi, mid, lo = constants.TWO_PI_PARTS
    assert float(np.float32(hi)) == hi  # 24 significant bits: k * hi is exact in float64 for |k| < 2**29
    assert hi + mid == 2 * math.pi  # float64(2*pi), exactly
    with mpmath.workdps(60):
        error = mpmath.mpf(hi) + mpmath.mpf(mid) + mpmath.mpf(lo) - 2 * mpmath.pi
        assert abs(error) < mpmath.mpf(2) ** -100
    k = constants.EXACT_LIMIT - 1
    with mpmath.workdps(60):
        assert mpmath.mpf(k * hi) == k * mpmath.mpf(hi)


@pytest.mark.parametrize("rotary_dim, head_dim, fits", [(2048, 4096, True), (2050, 4096, False), (64, 4098, False)])
def test_fits_is_the_table_held_by_the_kernel(rotary_dim, head_dim, fits):
    assert constants.fits(rotary_dim, head_dim) is fits
    table = Rope(head_dim=head_dim, rotary_dim=rotary_dim).table(2)
    assert (table.held is not None) is fits
