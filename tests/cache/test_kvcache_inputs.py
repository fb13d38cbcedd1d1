"""`KVCache`'s slots and writes: fresh and dropped slots are empty, moves to position 0, writes unlike the cache
refused, growth beyond memory refused."""

import pytest
import torch

import posenc
from posenc import PosencError, Rope
from posenc.cache import KVCache
from posenc.models import Decoder
from tests.helpers.tolerances import assert_close


def tiny_decoder(**kw):
    return Decoder(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8, **kw)

def _reserved_cache():
    cache = posenc.KVCache(1, 2, 2, 12, 8, rope=posenc.Rope(head_dim=12), dtype=torch.float64)
    return cache, cache.reserve(torch.tensor([[0, 1], [3, 4]]))


def test_fresh_cache_marks_every_slot_empty_and_unknown():
    """cache `self.tokens = torch.full(..., -1)`, mutant -1 -> 0: a fresh slot's token id is unknown (-1)."""
    cache = KVCache(2, 3, 1, 4, capacity=5)
    assert torch.equal(cache.tokens, torch.full((3, 5), -1))
    assert torch.equal(cache.positions, torch.full((3, 5), -1))
    cache.reserve(torch.tensor([[7, 8]]).expand(3, 2))  # positions without token ids: the ids stay unknown
    assert torch.equal(cache.tokens, torch.full((3, 5), -1))
    assert torch.equal(cache.positions[:, :2], torch.tensor([[7, 8]] * 3))
    # `clear` (mutant: tokens[rows] = -1 -> 0): a cleared row is empty and its ids unknown again
    cache.reserve(torch.tensor([[9]]).expand(3, 1), tokens=torch.tensor([[4], [5], [6]]))
    cache.clear(torch.tensor([True, False, True]))
    assert torch.equal(cache.tokens[:, 2], torch.tensor([-1, 5, -1]))
    assert torch.equal(cache.positions[0], torch.full((5,), -1)) and cache.lengths.tolist() == [0, 3, 0]


@pytest.mark.parametrize("store", ["rotated", "unrotated"])


def test_move_to_position_zero(store):
    """cache `move`: `new_positions < 0` refused, mutant `< 1`: moving a kept key to position 0 is valid and exact."""
    rope = Rope(head_dim=8)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64)
    moved, direct = (KVCache(1, 1, 2, 8, capacity=4, rope=rope, store=store, dtype=torch.float64) for _ in range(2))
    moved.write(0, k, v, moved.reserve(torch.tensor([[5, 6, 7]])))
    moved.move(torch.tensor([[0, 1, 2, -1]]))
    direct.write(0, k, v, direct.reserve(torch.tensor([[0, 1, 2]])))
    assert torch.equal(moved.positions, torch.tensor([[0, 1, 2, -1]]))
    assert_close(moved.read(0)[0], direct.read(0)[0], dtype=torch.float32)  # keys rotated by -5 in float32 tables


def test_dropped_slots_become_empty_and_unknown():
    """cache `keep`: dropped slots' token ids masked to -1, mutant -1 -> -2: a rolled-back slot is unknown again."""
    cache = KVCache(1, 2, 1, 4, capacity=4)
    cache.reserve(torch.tensor([[3, 4, 5], [0, 1, 2]]), tokens=torch.tensor([[10, 11, 12], [20, 21, 22]]))
    cache.rollback(torch.tensor([1, 2]))
    assert torch.equal(cache.tokens, torch.tensor([[10, 11, -1, -1], [20, -1, -1, -1]]))
    assert torch.equal(cache.positions, torch.tensor([[3, 4, -1, -1], [0, -1, -1, -1]]))
    assert torch.equal(cache.lengths, torch.tensor([2, 1]))


@pytest.mark.parametrize("bad, arg", [
    ({"k": torch.zeros(1, 2, 2, 12)}, "k"),  # another batch
    ({"v": torch.zeros(2, 2, 3, 12)}, "v"),  # more tokens than slots
    ({"k": torch.zeros(2, 2, 2, 10)}, "k"),  # another head width
    ({"v": [0.0]}, "v"),
    ({"slots": torch.tensor([[0, 5], [0, 1]])}, "slots"),  # slot 5 was never reserved
    ({"slots": torch.tensor([[0, 1]])}, "slots"),
    ({"slots": torch.tensor([[0.0, 1.0], [0.0, 1.0]])}, "slots"),
])


def test_kvcache_write_refuses_keys_values_and_slots_unlike_the_cache(bad, arg):
    cache, slots = _reserved_cache()
    g = torch.Generator().manual_seed(0)
    args = {"k": torch.randn(2, 2, 2, 12, generator=g), "v": torch.randn(2, 2, 2, 12, generator=g), "slots": slots}
    before = [x.clone() for x in (cache.k[0], cache.v[0])]
    with pytest.raises(PosencError, match=rf"^{arg}: expected"):
        cache.write(0, **(args | bad))
    assert torch.equal(cache.k[0], before[0]) and torch.equal(cache.v[0], before[1])  # nothing written


def test_kvcache_write_still_stores_the_rotated_keys_at_their_slots():
    cache, slots = _reserved_cache()
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 2, 12, generator=g, dtype=torch.float64), torch.randn(2, 2, 2, 12, generator=g, dtype=torch.float64)
    cache.write(0, k, v, slots)
    rotated, _ = posenc.Rope(head_dim=12).apply(k, k, torch.tensor([[0, 1], [3, 4]]))
    assert torch.equal(cache.v[0][:, :, :2], v)
    assert torch.allclose(cache.k[0][:, :, :2], rotated, atol=1e-6, rtol=0)  # float32 rotation of float64 keys


def test_growing_or_batching_a_cache_beyond_memory_is_refused_by_name():
    model = tiny_decoder()
    cache = model.new_cache(1, 4)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
    with pytest.raises(PosencError, match=r"capacity: expected a cache that fits in memory"):
        cache.grow(2**45)
    assert cache.capacity == 4 and cache.lengths.tolist() == [3]  # unchanged by the refusal
    kept = cache.k[0][:, :, :3].clone()
    cache.grow(9)  # a real growth keeps the filled slots
    assert cache.capacity == 9 and torch.equal(cache.k[0][:, :, :3], kept) and not cache.k[0][:, :, 3:].any()
    with pytest.raises(PosencError, match=r"batch_size: expected a cache that fits in memory"):
        model.new_cache(2**45, 1)
    with pytest.raises(PosencError, match=r"path: expected a .gguf file or transformers directory \(a str or"):
        Decoder.from_pretrained(123)
