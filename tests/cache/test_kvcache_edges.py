"""KVCache and decoder edge cases: absolute encodings cannot be moved, empty steps, unsigned positions,
bad arguments to rollback / reorder, dropped slots zeroed, and messages in each caller's own names."""

import pytest
import torch

import posenc
from posenc import KVCache, PosencError
from posenc.models import Decoder

CFG = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 24}
ENCODINGS = {
    "rope": lambda: None,  # the config's Rope
    "sinusoidal": lambda: posenc.Sinusoidal(16),
    "learned": lambda: posenc.LearnedPositions(32, 16),
    "alibi": lambda: posenc.ALiBi(4),
}
UNSIGNED = [torch.uint8, torch.uint16, torch.uint32, torch.uint64]


def decoder(name):
    return Decoder.from_hf_config(CFG, encoding=ENCODINGS[name](), seed=0).double()


def ids(shape, seed=1):
    return torch.randint(1, 50, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def filled_cache(name, tokens=8, capacity=12):
    """The cache of a one-row forward over `tokens` tokens of the decoder for encoding `name`."""
    m = decoder(name)
    cache = m.new_cache(1, capacity)
    m(ids((1, tokens)), cache=cache)
    return cache


@torch.no_grad()
@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_absolute_caches_refuse_to_move(name):
    """K/V of an absolute encoding carry their positions: relabelling slots would be silently wrong."""
    cache = filled_cache(name)
    state = (cache.positions.clone(), cache.k[0].clone(), cache.lengths.clone())
    with pytest.raises(PosencError, match=r"^shift: expected False for a cache of absolute position embeddings"):
        cache.keep_recent(4, 1, shift=True)
    moved = torch.where(cache.valid(), cache.positions + 3, -1)
    with pytest.raises(PosencError, match=r"^new_positions: expected the current positions: .*absolute position"):
        cache.move(moved)
    assert all(torch.equal(a, b) for a, b in zip(state, (cache.positions, cache.k[0], cache.lengths)))
    cache.move(cache.positions.clone())  # the same positions: nothing moves, nothing to refuse
    cache.keep_recent(4, 1)  # without shift the kept tokens keep their positions: allowed
    assert cache.positions[0, :6].tolist() == [0, 4, 5, 6, 7, -1]


@torch.no_grad()
@pytest.mark.parametrize("name", ["rope", "alibi"])
def test_relative_caches_still_move(name):
    cache = filled_cache(name)
    cache.keep_recent(4, 1, shift=True)
    assert cache.positions[0, :6].tolist() == [0, 1, 2, 3, 4, -1] and not cache.absolute


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_all_padding_step_with_an_empty_cache(name):
    """Every row padding, nothing cached: finite logits, the cache stays empty, the next step is unaffected."""
    m = decoder(name)
    cache = m.new_cache(2, 8)
    out = m(ids((2, 3)), attention_mask=torch.zeros(2, 3, dtype=torch.long), cache=cache)
    assert out.shape == (2, 3, 50) and bool(out.isfinite().all())
    assert cache.lengths.tolist() == [0, 0] and cache.next_positions().tolist() == [0, 0]
    after = m(ids((2, 4), seed=2), cache=cache)
    assert torch.equal(after, m(ids((2, 4), seed=2), cache=m.new_cache(2, 8)))
    out = m(ids((2, 3)), attention_mask=torch.zeros(2, 3, dtype=torch.long))  # no cache at all
    assert bool(out.isfinite().all())


@torch.no_grad()
@pytest.mark.parametrize("dtype", UNSIGNED + [torch.int16])
def test_decoder_takes_any_integer_ids_and_positions(dtype):
    m = decoder("rope")
    x, pos = ids((2, 5)), torch.tensor([3, 4, 6, 9, 10])
    want = m(x, position_ids=pos)
    assert torch.equal(m(x.to(dtype), position_ids=pos.to(dtype)), want)


@pytest.mark.parametrize("dtype", UNSIGNED)
def test_cache_takes_unsigned_positions(dtype):
    a, b = (KVCache(1, 2, 1, 4, capacity=6, rope=posenc.Rope(head_dim=4)) for _ in range(2))
    pos = torch.tensor([[0, 1, 2], [4, 5, 6]])
    a.reserve(pos)
    b.reserve(pos.to(dtype))
    assert torch.equal(a.positions, b.positions)
    a.move(torch.where(a.valid(), a.positions + 1, -1))
    b.move((b.positions + 1).to(dtype))  # empty slots (-1 + 1 = 0) are ignored
    assert torch.equal(a.positions, b.positions)
    b.rollback(torch.tensor([1, 2]).to(dtype))
    b.reorder(torch.tensor([1, 0]).to(dtype))
    assert b.lengths.tolist() == [1, 2]


@pytest.mark.parametrize("n", [torch.tensor([1, 1, 1]), torch.tensor([[1, 1]]), "a", None, 1.5, -1, 4,
                               torch.tensor([0, 4]), torch.tensor([-1, 0]), torch.tensor([1.0, 1.0])])
def test_rollback_refuses(n):
    cache = KVCache(1, 2, 1, 4, capacity=6)
    cache.reserve(torch.tensor([[0, 1, 2], [0, 1, 2]]))
    with pytest.raises(PosencError, match=r"^n: expected an integer \(or \[b=2\] integers\) in \[0, lengths=\[3, 3\]\]"):
        cache.rollback(n)
    assert cache.lengths.tolist() == [3, 3]


@pytest.mark.parametrize("index", [torch.tensor([2]), torch.tensor([-1]), torch.tensor([[0]]), [0, 1],
                                   torch.tensor([0.0])])
def test_reorder_refuses(index):
    cache = KVCache(1, 2, 1, 4, capacity=6)
    with pytest.raises(PosencError, match=r"^index: expected "):
        cache.reorder(index)


def test_dropped_slots_are_zeroed():
    """keep / rollback leave no stale key or value behind a dropped slot (a later read never sees it)."""
    g = torch.Generator().manual_seed(0)
    cache = KVCache(2, 2, 2, 4, capacity=6, rope=posenc.Rope(head_dim=4))
    slots = cache.reserve(torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]]))
    for layer in range(2):
        cache.write(layer, torch.randn(2, 2, 4, 4, generator=g), torch.randn(2, 2, 4, 4, generator=g), slots)
    cache.keep(torch.tensor([[True, False, True, True, False, False], [False, True, True, True, False, False]]))
    cache.rollback(torch.tensor([1, 0]))
    assert cache.lengths.tolist() == [2, 3]
    for buffers in (cache.k, cache.v):
        for x in buffers:
            assert not x[0, :, 2:].any() and not x[1, :, 3:].any()
            assert x[0, :, :2].abs().min() > 0 and x[1, :, :3].abs().min() > 0


@torch.no_grad()
def test_decoder_messages_use_its_own_names():
    m = decoder("rope")
    cache = m.new_cache(1, 4)
    m(ids((1, 3)), cache=cache)
    with pytest.raises(PosencError, match=r"^input_ids: expected at most 1 new tokens in row 0 \(capacity 4, 3 used\); .*"
                       r"new_cache\(batch_size, capacity=5\) or more, or capacity=None to grow on demand, got 2$"):
        m(ids((1, 2)), cache=cache)
    with pytest.raises(PosencError, match=r"^position_ids: expected row 0 past its last cached position 2;"):
        m(ids((1, 1)), position_ids=torch.tensor([2]), cache=cache)
    with pytest.raises(PosencError, match=r"^attention_mask: expected a 0/1 tensor"):
        m(ids((1, 1)), attention_mask=torch.tensor([[2]]), cache=cache)
    with pytest.raises(PosencError, match=r"^position_ids: expected positions >= 0 for unmasked tokens, got min -1$"):
        m(ids((1, 1)), position_ids=torch.tensor([-1]), cache=cache)
    # a forward without a cache: decreasing positions are a problem of this call, nothing is cached
    with pytest.raises(PosencError, match=r"^position_ids: expected row 0 strictly increasing \(the token before it "
                                          r"is at 2\); each position holds one token, got 1$") as info:
        m(ids((1, 3)), position_ids=torch.tensor([0, 2, 1]))
    assert "cached" not in str(info.value)


@pytest.mark.parametrize("call, message", [
    (lambda c: c.read(1), r"^layer: expected an integer in \[0, 0\], got 1$"),
    (lambda c: c.read(-1), r"^layer: expected an integer in \[0, 0\], got -1$"),
    (lambda c: c.write("0", torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, dtype=torch.long)),
     r"^layer: expected an integer in \[0, 0\], got '0'$"),
    (lambda c: c.clear(torch.tensor([1, 0])), r"^rows: expected None or a bool tensor of shape \[2\]"),
    (lambda c: c.retable(torch.tensor([4])), r"^seq_lens: expected 2 lengths \(one per row\)"),
    (lambda c: c.retable([4, 4]), r"^seq_lens: expected an integer torch\.Tensor of rank 1, got list$"),
    (lambda c: c.tables(torch.tensor([0, 1])), r"^positions: expected shape \[2, t\]"),
])
def test_cache_methods_refuse_bad_arguments(call, message):
    cache = KVCache(1, 2, 1, 4, capacity=6, rope=posenc.Rope(head_dim=4))
    cache.reserve(torch.tensor([[0, 1, 2], [3, 4, 5]]))
    with pytest.raises(PosencError, match=message):
        call(cache)
    assert cache.lengths.tolist() == [3, 3]
