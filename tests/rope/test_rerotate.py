"""posenc.rerotate: moving rotated keys to new positions and tables equals rotating the raw keys there."""

import pytest
import torch
from tests.helpers.tolerances import assert_close

import posenc
from posenc import PosencError, Rope, rerotate

L0 = 64
ROPES = {
    "split_half": Rope(head_dim=16),
    "interleaved_partial": Rope(head_dim=18, rotary_dim=10, pairing="interleaved"),
    "deepseek": Rope(head_dim=8, pairing="interleaved_to_split_half"),
    "yarn": Rope(head_dim=16, scaling=posenc.YaRN(factor=4.0, original_max_positions=L0)),
    "dynamic": Rope(head_dim=16, scaling=posenc.DynamicNTK(factor=2.0, max_positions=L0)),
    "longrope": Rope(head_dim=8, scaling=posenc.LongRoPE((1.0, 1.1, 1.2, 1.3), (1.0, 2.0, 4.0, 8.0), L0, 1.19)),
}


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_shift_equals_rotating_at_new_positions(name, dtype, gen):
    rope = ROPES[name]
    k = torch.randn(2, 3, 7, rope.head_dim, generator=gen, dtype=dtype)
    old = torch.tensor([[40, 41, 45, 50, 51, 52, 60], [3, 9, 10, 11, 12, 13, 14]])  # [b, t]
    new = torch.arange(7).expand(2, 7)
    want = rope.rotate(k, new, seq_len=L0)
    got = rerotate(rope, rope.rotate(k, old, seq_len=L0), old, new, old_seq_len=L0, new_seq_len=L0)
    assert got.dtype == dtype
    # float32 keys: the stored key was rounded to float32 once, the map adds one more rounding
    assert_close(got, want, dtype=dtype if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_table_switch_equals_rotating_with_the_new_table(name, gen):
    """A key cached below L0 moved to the table of a longer sequence equals the key rotated with that table."""
    rope = ROPES[name]
    k = torch.randn(1, 2, 5, rope.head_dim, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0, 7, 30, 62, 63])
    before = rope.rotate(k, pos, seq_len=L0)
    after = rerotate(rope, before, pos, pos, old_seq_len=L0, new_seq_len=3 * L0)
    want = rope.rotate(k, pos, seq_len=3 * L0)
    assert not torch.allclose(before, want)  # the table really changed
    assert_close(after, want)


def test_round_trip_is_identity(gen):
    rope = ROPES["split_half"]
    k = torch.randn(1, 2, 4, 16, generator=gen, dtype=torch.float64)
    a, b = torch.tensor([5, 6, 7, 8]), torch.tensor([100, 200, 300, 400])
    assert_close(rerotate(rope, rerotate(rope, k, a, b), b, a), k)


@pytest.mark.parametrize("old, new, match", [
    (torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), "old_positions: expected an integer dtype"),
    (torch.tensor([0, 1]), torch.tensor([-1, 1]), "new_positions: expected positions >= 0"),
    (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), r"^old_positions: expected shape \[2\] or \[b, 2\]"),
    (torch.tensor([[0, 1]] * 3), torch.tensor([0, 1]), r"^old_positions: expected batch size 1 or 2, got tensor of shape \(3, 2\)"),
    (torch.tensor([0, 1]), torch.tensor([[0, 1]] * 3), r"^new_positions: expected batch size 1 or 2, got tensor of shape \(3, 2\)"),
    ([0, 1], torch.tensor([0, 1]), r"^old_positions: expected an integer torch\.Tensor, got list$"),
])
def test_bad_positions(old, new, match):
    k = torch.randn(2, 1, 2, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(PosencError, match=match):
        rerotate(ROPES["split_half"], k, old, new)


@pytest.mark.parametrize("width", [8, 12, 18])
def test_keys_of_another_width_are_refused(width):
    """A key narrower or wider than head_dim would be rotated with the wrong pairs: refused."""
    k = torch.randn(1, 1, 2, width, generator=torch.Generator().manual_seed(0))
    with pytest.raises(PosencError, match=rf"^k: expected last dim = head_dim = 16 .*got tensor of shape \(1, 1, 2, {width}\)"):
        rerotate(ROPES["split_half"], k, torch.tensor([0, 1]), torch.tensor([2, 3]))
    with pytest.raises(PosencError, match=r"^k: expected a tensor of rank 4"):
        rerotate(ROPES["split_half"], k[0], torch.tensor([0, 1]), torch.tensor([2, 3]))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int32])
def test_unsigned_positions_equal_int64(dtype, gen):
    rope = ROPES["split_half"]
    k = torch.randn(2, 2, 3, 16, generator=gen, dtype=torch.float64)
    old, new = torch.tensor([[4, 5, 6], [7, 8, 9]]), torch.tensor([1, 2, 3])
    want = rerotate(rope, k, old, new)
    assert torch.equal(rerotate(rope, k, old.to(dtype), new.to(dtype)), want)
