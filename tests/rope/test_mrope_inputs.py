"""`mrope_cos_sin`'s inputs: inverse frequencies and positions it cannot use, refused by name."""

import numpy as np
import pytest
import torch

import posenc
from posenc import PosencError


@pytest.mark.parametrize("inv_freq", [[1.0, 0.5, 0.25, 0.125], np.ones(4), torch.ones(()), torch.ones(4, dtype=torch.long),
                                      torch.ones(1, 4)])


def test_mrope_cos_sin_refuses_inverse_frequencies_that_are_not_a_1d_float_tensor(inv_freq):
    with pytest.raises(PosencError, match=r"^inv_freq: expected a (floating-point|tensor of rank 1)"):
        posenc.mrope_cos_sin(torch.zeros(3, 1, 5, dtype=torch.long), inv_freq, (2, 1, 1))


def test_mrope_cos_sin_refuses_positions_on_another_device_than_the_frequencies():
    with pytest.raises(PosencError, match=r"^position_ids: expected a tensor on meta"):
        posenc.mrope_cos_sin(torch.zeros(3, 1, 5, dtype=torch.long), torch.ones(4, device="meta"), (2, 1, 1))
