"""`packed_positions` with unsigned cu_seqlens."""

import pytest
import torch

from posenc import PosencError
from posenc.rope.packed import packed_positions


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32])


def test_packed_positions_with_unsigned_cu_seqlens(dtype):
    assert packed_positions(torch.tensor([0, 2, 5], dtype=dtype)).tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(PosencError, match=r"cu_seqlens: expected non-decreasing cumulative lengths, got \[0, 5, 3\]"):
        packed_positions(torch.tensor([0, 5, 3], dtype=dtype))  # uint8 wrapped 3 - 5 to 254 and passed
    got = packed_positions(torch.tensor([0, 2, 5], dtype=dtype), offsets=torch.tensor([7, 1], dtype=dtype))
    assert got.tolist() == [7, 8, 1, 2, 3]
