"""KVCache: slots keep logical positions; rotated and unrotated storage; rollback, reorder, windows, shifts.

Oracles: explicit 2x2 rotations of raw keys written here in float64 from the Rope's own tables.
"""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import posenc
from posenc.cache import KVCache
from posenc.rope.rerotate import rerotation_tables, row_tables
from posenc.rope.scaling import default_inv_freq
from tests.helpers.tolerances import assert_close
from tests.helpers.oracles import rotate_pairs

F64 = torch.float64


def fill(cache, positions, gen, mask=None):
    """Reserve and write random raw keys/values into every layer; return the raw keys per layer."""
    b, t = positions.shape
    hk, d = cache.k[0].shape[1], cache.k[0].shape[3]
    slots = cache.reserve(positions, mask)
    raws = []
    for layer in range(cache.num_layers):
        k = torch.randn(b, hk, t, d, generator=gen, dtype=F64)
        cache.write(layer, k, torch.randn(b, hk, t, d, generator=gen, dtype=F64), slots)
        raws.append(k)
    return raws


ROPES = {
    "split": posenc.Rope(head_dim=10),
    "partial": posenc.Rope(head_dim=10, rotary_dim=6, base=500.0),
    "interleaved": posenc.Rope(head_dim=10, pairing="interleaved"),
    "i2s": posenc.Rope(head_dim=10, pairing="interleaved_to_split_half"),
    "yarn": posenc.Rope(head_dim=10, scaling=posenc.YaRN(factor=4.0, original_max_positions=8)),
}


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("store", ["rotated", "unrotated"])
def test_read_returns_keys_rotated_at_slot_positions(name, store, gen):
    rope = ROPES[name]
    cache = KVCache(2, 3, 2, 10, capacity=9, rope=rope, store=store, dtype=F64)
    pos = torch.tensor([[0, 1, 2, 3], [4, 9, 10, 30], [2, 3, 5, 7]])
    mask = torch.tensor([[True] * 4, [False, True, True, True], [True, True, False, True]])
    raws = fill(cache, pos, gen, mask)
    assert cache.lengths.tolist() == [4, 3, 3]
    assert cache.positions[:, :4].tolist() == [[0, 1, 2, 3], [9, 10, 30, -1], [2, 3, 7, -1]]
    for layer in range(2):
        keys, _ = cache.read(layer)  # [3, 2, 4, 10]
        for row in range(3):
            kept = mask[row].nonzero().flatten()
            cos, sin = rope.cos_sin(pos[row, kept])  # [n, r/2]
            expected = rotate_pairs(raws[layer][row:row + 1, :, kept], cos, sin, rope.pairing)
            assert_close(keys[row:row + 1, :, : len(kept)], expected)


def test_append_refuses_repeated_or_decreasing_positions_and_overflow():
    cache = KVCache(1, 2, 1, 4, capacity=5, rope=posenc.Rope(head_dim=4))
    cache.reserve(torch.tensor([[0, 1, 2], [0, 1, 2]]))
    before = cache.positions.clone()
    with pytest.raises(posenc.PosencError, match=r"^positions: expected row 0 past its last cached position 2;"):
        cache.reserve(torch.tensor([[2], [3]]))  # first decode position repeats the last prefill position
    with pytest.raises(posenc.PosencError, match=r"^positions: expected row 0 strictly increasing \(the token before it is at 4\)"):
        cache.reserve(torch.tensor([[4, 4], [3, 4]]))
    with pytest.raises(posenc.PosencError, match=r"^positions: expected at most 2 new tokens in row 1 \(capacity 5, 3 used\); size the cache for "
                       r"prompt \+ generated tokens, e\.g\. new_cache\(batch_size, capacity=6\) or more, or "
                       r"capacity=None to grow on demand, got 3$"):
        cache.reserve(torch.tensor([[3, 4, 5], [3, 4, 5]]), torch.tensor([[True, True, False], [True] * 3]))
    with pytest.raises(posenc.PosencError, match=r"^positions: expected positions >= 0 for unmasked tokens, got min -1$"):
        cache.reserve(torch.tensor([[-1], [3]]))
    with pytest.raises(posenc.PosencError, match=r"^mask: expected a bool tensor of shape \(2, 1\)"):
        cache.reserve(torch.tensor([[3], [3]]), torch.tensor([[1], [1]]))
    with pytest.raises(posenc.PosencError, match=r"^positions: expected shape \[2, t\]"):
        cache.reserve(torch.tensor([3]))
    with pytest.raises(posenc.PosencError, match=r"^tokens: expected None or an integer tensor of shape \(2, 1\)"):
        cache.reserve(torch.tensor([[3], [3]]), tokens=torch.tensor([1, 2]))
    assert torch.equal(cache.positions, before) and cache.lengths.tolist() == [3, 3]
    cache.reserve(torch.tensor([[7, 8], [3, 9]]))  # gaps are fine: positions are logical
    assert cache.next_positions().tolist() == [9, 10]


def test_rollback_then_append_equals_never_appending(gen):
    rope = ROPES["split"]
    a = KVCache(2, 2, 2, 10, capacity=8, rope=rope, dtype=F64)
    b = KVCache(2, 2, 2, 10, capacity=8, rope=rope, dtype=F64)
    g2 = torch.Generator().manual_seed(0)
    fill(a, torch.tensor([[0, 1, 2], [5, 6, 7]]), gen)
    fill(b, torch.tensor([[0, 1, 2], [5, 6, 7]]), g2)
    fill(a, torch.tensor([[3, 4, 5], [8, 9, 10]]), gen)  # speculative tokens, then rejected
    a.rollback(torch.tensor([3, 2]))
    assert a.lengths.tolist() == [3, 4] and a.next_positions().tolist() == [3, 9]
    a.rollback(torch.tensor([0, 1]))
    assert a.positions[:, :4].tolist() == b.positions[:, :4].tolist() == [[0, 1, 2, -1], [5, 6, 7, -1]]
    for layer in range(2):
        assert torch.equal(a.read(layer)[0], b.read(layer)[0]) and torch.equal(a.read(layer)[1], b.read(layer)[1])
    with pytest.raises(posenc.PosencError, match="n: expected"):
        a.rollback(4)


def test_reorder_moves_rows_with_their_positions(gen):
    cache = KVCache(1, 3, 1, 10, capacity=6, rope=ROPES["split"], store="unrotated", dtype=F64)
    fill(cache, torch.tensor([[0, 1, 2], [3, 4, 5], [10, 20, 30]]), gen,
         torch.tensor([[True] * 3, [False, True, True], [True] * 3]))
    keys = cache.read(0)[0].clone()
    cache.reorder(torch.tensor([2, 0, 0, 1]))
    assert cache.batch_size == 4 and cache.lengths.tolist() == [3, 3, 3, 2]
    assert cache.positions[:, :3].tolist() == [[10, 20, 30], [0, 1, 2], [0, 1, 2], [4, 5, -1]]
    assert torch.equal(cache.read(0)[0][:3], keys[[2, 0, 0]])
    with pytest.raises(posenc.PosencError, match="index"):
        cache.reorder(torch.tensor([4]))


def test_keep_recent_with_sinks_and_shift_equals_reencoding(gen):
    for name in ("split", "partial", "interleaved", "i2s", "yarn"):
        rope = ROPES[name]
        rotated = KVCache(2, 2, 2, 10, capacity=12, rope=rope, store="rotated", dtype=F64)
        unrotated = KVCache(2, 2, 2, 10, capacity=12, rope=rope, store="unrotated", dtype=F64)
        pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8]]) + torch.tensor([[0], [100]])
        mask = torch.ones(2, 9, dtype=torch.bool)
        mask[1, :2] = False  # a left-padded row
        g2 = torch.Generator().manual_seed(1)
        raws = fill(rotated, pos, g2, mask)
        fill(unrotated, pos, torch.Generator().manual_seed(1), mask)
        for cache in (rotated, unrotated):
            cache.keep_recent(window=3, sinks=2, shift=True)
        assert rotated.positions[:, :6].tolist() == [[0, 1, 2, 3, 4, -1], [102, 103, 104, 105, 106, -1]]
        kept = [[0, 1, 6, 7, 8], [2, 3, 6, 7, 8]]  # columns of the original input that survive
        for layer in range(2):
            k_rot, v_rot = rotated.read(layer)
            k_un, v_un = unrotated.read(layer)
            assert_close(k_rot, k_un)
            assert torch.equal(v_rot, v_un)
            for row in range(2):
                raw = raws[layer][row:row + 1, :, kept[row]]  # [1, hk, 5, d]
                cos, sin = rope.cos_sin(rotated.positions[row, :5])
                assert_close(k_rot[row:row + 1], rotate_pairs(raw, cos, sin, rope.pairing))


def test_move_refuses_unordered_positions(gen):
    cache = KVCache(1, 1, 1, 10, capacity=4, rope=ROPES["split"], dtype=F64)
    fill(cache, torch.tensor([[0, 1, 2]]), gen)
    with pytest.raises(posenc.PosencError, match="strictly increasing"):
        cache.move(torch.tensor([[0, 2, 2, 3]]))
    with pytest.raises(posenc.PosencError, match="new_positions"):
        cache.move(torch.tensor([[0, 1]]))


@dataclass(frozen=True)
class TwoTables:
    """A test-only length-dependent scaling whose attention factor also changes with length."""

    name: ClassVar[str] = "two_tables"
    depends_on_length: ClassVar[bool] = True

    def inv_freq(self, base, dim, seq_len=None):
        inv = default_inv_freq(base, dim)
        if seq_len is not None and seq_len > 8:
            return inv / torch.linspace(1.0, 3.0, dim // 2), 1.7
        return inv, 1.0


@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@pytest.mark.parametrize("scaling", [TwoTables(), posenc.DynamicNTK(factor=3.0, max_positions=8),
                                     posenc.LongRoPE((1.0, 1.1, 1.3, 2.0), (2.0, 3.0, 5.0, 9.0), 8, 1.3)])
def test_rerotate_policy_equals_the_new_table(scaling, store, gen):
    rope = posenc.Rope(head_dim=8, scaling=scaling)
    cache = KVCache(2, 2, 1, 8, capacity=8, rope=rope, store=store, policy="rerotate", dtype=F64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]])
    cache.retable(torch.tensor([5, 7]))
    raws = fill(cache, pos, gen)
    assert cache.retable(torch.tensor([5, 20])).tolist() == [False, False]  # rerotate never asks to re-run
    assert cache.table_len.tolist() == [5, 20]
    for layer in range(2):
        keys = cache.read(layer)[0]
        for row, length in ((0, 5), (1, 20)):
            cos, sin = rope.cos_sin(pos[row], seq_len=length)
            assert_close(keys[row:row + 1], rotate_pairs(raws[layer][row:row + 1], cos, sin, "split_half"))


def test_rerotation_tables_compose_to_the_new_table():
    rope = posenc.Rope(head_dim=8, scaling=TwoTables())
    old_p, new_p = torch.tensor([[3, 50, 1000]]), torch.tensor([[1, 40, 7]])
    cd, sd = rerotation_tables(rope, old_p, new_p, torch.tensor([4]), torch.tensor([30]))
    co, so = (x.double() for x in rope.cos_sin(old_p, seq_len=4))
    cn, sn = (x.double() for x in rope.cos_sin(new_p, seq_len=30))
    # R(delta) @ R_old == R_new, as 2x2 matrices [[c, -s], [s, c]]
    assert_close(cd * co - sd * so, cn)
    assert_close(sd * co + cd * so, sn)
    cos, sin = row_tables(rope, torch.tensor([[2, 3], [2, 3]]), torch.tensor([4, 30]))
    assert_close(cos[1].double(), rope.cos_sin(torch.tensor([2, 3]), seq_len=30)[0].double())
    assert not torch.equal(cos[0], cos[1])


def test_policies_freeze_and_refuse(gen):
    rope = posenc.Rope(head_dim=8, scaling=posenc.DynamicNTK(factor=2.0, max_positions=8))
    frozen = KVCache(1, 2, 1, 8, capacity=8, rope=rope, policy="freeze", dtype=F64)
    frozen.retable(torch.tensor([6, 3]))
    fill(frozen, torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]]), gen,
         torch.tensor([[True] * 6, [True] * 3 + [False] * 3]))
    keys = frozen.read(0)[0].clone()
    assert frozen.retable(torch.tensor([12, 4])).tolist() == [False, False]
    assert frozen.table_len.tolist() == [6, 3] and torch.equal(frozen.read(0)[0], keys)
    refuse = KVCache(1, 1, 1, 8, capacity=8, rope=rope, policy="refuse", dtype=F64)
    refuse.retable(torch.tensor([5]))
    fill(refuse, torch.tensor([[0, 1, 2, 3, 4]]), gen)
    refuse.retable(torch.tensor([8]))  # same (unscaled) table up to max_positions: accepted
    before = refuse.read(0)[0].clone()
    with pytest.raises(posenc.PosencError, match="policy: expected a table that stays the same"):
        refuse.retable(torch.tensor([9]))
    assert torch.equal(refuse.read(0)[0], before) and refuse.table_len.tolist() == [8]
    recompute = KVCache(1, 1, 1, 8, capacity=8, rope=rope, dtype=F64)
    recompute.retable(torch.tensor([5]))
    fill(recompute, torch.tensor([[0, 1, 2, 3, 4]]), gen)
    assert recompute.retable(torch.tensor([9])).tolist() == [True]


@pytest.mark.parametrize("kwargs, match", [
    (dict(store="both"), "store"), (dict(policy="ignore"), "policy"), (dict(capacity=0), "capacity"),
    (dict(rope=posenc.Rope(head_dim=6)), "rope"), (dict(dtype=torch.int64), "dtype"),
])
def test_constructor_refuses_bad_arguments(kwargs, match):
    args = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=4, capacity=4) | kwargs
    with pytest.raises(posenc.PosencError, match=match):
        KVCache(args.pop("num_layers"), args.pop("batch_size"), args.pop("num_kv_heads"), args.pop("head_dim"),
                args.pop("capacity"), **args)
