"""`rerotate` refuses an encoding that is not a Rope, by name."""

import pytest
import torch

import posenc
from posenc import PosencError


@pytest.mark.parametrize("rope", [None, 8, "rope", posenc.ALiBi(2)])


def test_rerotate_refuses_a_rope_that_is_not_a_rope(rope):
    k = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(PosencError, match=r"^rope: expected a posenc.Rope"):
        posenc.rerotate(rope, k, torch.arange(3), torch.arange(3) + 2)
