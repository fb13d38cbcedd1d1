"""Paged storage: block tables move on reorder, forks share blocks, writes copy on write, nothing leaks.

Oracles: the contiguous store fed the same operations (bit-exact: the same arithmetic), the blocks'
own bytes before and after (data_ptr and contents), and reference counts recounted from the tables.
"""

import pytest
import torch

import posenc
from posenc import PosencError
from posenc.cache import KVCache
from tests.helpers.tolerances import assert_close

F64 = torch.float64
ROPE = posenc.Rope(head_dim=4)


def filled(block_size, b=3, capacity=8, t=5, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(2, b, 2, 4, capacity, rope=ROPE, dtype=F64, block_size=block_size, **kw)
    slots = cache.reserve(torch.arange(t).repeat(b, 1))
    for layer in range(2):
        cache.write(layer, torch.randn(b, 2, t, 4, generator=g, dtype=F64), torch.randn(b, 2, t, 4, generator=g,
                                                                                        dtype=F64), slots)
    return cache


def step(cache, seed=1):
    g = torch.Generator().manual_seed(seed)
    b = cache.batch_size
    slots = cache.reserve(cache.next_positions()[:, None])
    for layer in range(2):
        cache.write(layer, torch.randn(b, 2, 1, 4, generator=g, dtype=F64), torch.randn(b, 2, 1, 4, generator=g,
                                                                                        dtype=F64), slots)


def test_reorder_moves_block_tables_not_blocks():
    cache = filled(block_size=2)
    pools = [p for store in cache.stores for p in store.pools]
    before = [(p.data_ptr(), p.clone()) for p in pools]
    keys = cache.read(1, width=8)[0].clone()
    cache.reorder(torch.tensor([0, 0, 0]))  # three samples forked from row 0's prompt
    after = [p for store in cache.stores for p in store.pools]
    assert all(p.data_ptr() == ptr and torch.equal(p, old) for p, (ptr, old) in zip(after, before))
    assert cache.pages.table.tolist() == [[0, 1, 2, 3]] * 3
    assert cache.pages.refs.tolist() == [3, 3, 3, 3] + [0] * 8  # rows 1 and 2's blocks are free
    assert torch.equal(cache.read(1, width=8)[0], keys[[0, 0, 0]])


def test_a_fork_shares_its_prompt_and_copies_only_the_block_it_writes():
    paged, flat = filled(block_size=2), filled(block_size=None)
    for cache in (paged, flat):
        cache.reorder(torch.tensor([0, 0, 0]))
        step(cache)  # slot 5, in block 2 (slots 4, 5): each row writes into the shared block
    table = paged.pages.table.tolist()
    assert [row[:2] for row in table] == [[0, 1]] * 3  # untouched prompt blocks stay shared
    assert len({row[2] for row in table}) == 3  # the written block: one original, two copies from the free list
    assert {row[2] for row in table} - {2} <= set(range(4, 12))
    refs = torch.zeros(12, dtype=torch.long).scatter_add_(0, paged.pages.table.flatten(), torch.ones(12, dtype=torch.long))
    assert torch.equal(paged.pages.refs, refs)  # counts equal a recount from the tables
    for layer in range(2):
        assert all(torch.equal(x, y) for x, y in zip(paged.read(layer, width=8), flat.read(layer, width=8)))


def test_rollback_of_a_fork_leaves_its_siblings_intact():
    paged, flat = filled(block_size=3), filled(block_size=None)
    for cache in (paged, flat):
        cache.reorder(torch.tensor([1, 1, 1]))
        cache.rollback(torch.tensor([0, 2, 4]))
        step(cache)
    for layer in range(2):
        assert all(torch.equal(x, y) for x, y in zip(paged.read(layer, width=8), flat.read(layer, width=8)))
    assert paged.lengths.tolist() == [6, 4, 2]


def test_growth_and_batch_changes_match_the_contiguous_store():
    paged, flat = filled(block_size=3, capacity=None, t=70), filled(block_size=None, capacity=None, t=70)
    assert paged.capacity == flat.capacity == 128
    for cache in (paged, flat):
        cache.reorder(torch.tensor([2, 0, 1, 1, 0]))  # more rows: the pools gain free blocks
        step(cache)
        cache.reorder(torch.tensor([3, 4]))  # fewer rows
        step(cache, seed=2)
    assert paged.pages.refs.sum() == paged.pages.table.numel()
    for layer in range(2):
        assert all(torch.equal(x, y) for x, y in zip(paged.read(layer, width=72), flat.read(layer, width=72)))


@pytest.mark.parametrize("block_size", [0, -2, 2.5, True, "4", torch.tensor(4)])
def test_a_bad_block_size_is_refused_by_name(block_size):
    with pytest.raises(PosencError, match=r"^block_size: expected None or a positive integer, got "):
        KVCache(1, 1, 1, 4, 8, block_size=block_size)
    model = posenc.models.Decoder(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8)
    with pytest.raises(PosencError, match=r"^block_size: expected"):
        model.new_cache(1, 8, block_size=block_size)


@pytest.mark.parametrize("capacity", [0, -1, 3.0, "8"])
def test_a_bad_capacity_is_refused_by_name(capacity):
    with pytest.raises(PosencError, match=r"^capacity: expected a positive integer"):
        KVCache(1, 1, 1, 4, capacity, block_size=2)


def test_a_refused_call_writes_nothing():
    cache = filled(block_size=2)
    cache.reorder(torch.tensor([0, 0, 1]))  # shared blocks: a write would copy them first
    state = lambda: [cache.pages.table.clone(), cache.pages.refs.clone(), cache.positions.clone(),
                     cache.lengths.clone()] + [p.clone() for s in cache.stores for p in s.pools]
    before = state()
    with pytest.raises(PosencError, match=r"^positions: expected row 0 past its last cached position 4"):
        cache.reserve(torch.tensor([[4], [5], [5]]))
    with pytest.raises(PosencError, match=r"^positions: expected at most 3 new tokens in row 0"):
        cache.reserve(torch.tensor([[5, 6, 7, 8]] * 3))
    with pytest.raises(PosencError, match=r"^slots: expected"):
        cache.write(0, torch.ones(3, 2, 1, 4, dtype=F64), torch.ones(3, 2, 1, 4, dtype=F64), torch.tensor([[5]] * 3))
    assert all(torch.equal(x, y) for x, y in zip(before, state()))


@pytest.mark.parametrize("block_size", [None, 2])
def test_edits_keep_the_tensors_a_caller_holds(block_size):
    """keep, rollback, reorder and move work in place: references taken before see the edit."""
    cache = filled(block_size=block_size)
    def tensors():
        views = cache.k + cache.v if block_size is None else [p for s in cache.stores for p in s.pools]
        return [cache.positions, cache.lengths, cache.tokens, cache.table_len] + views

    held = tensors()
    cache.rollback(torch.tensor([1, 0, 2]))
    cache.reorder(torch.tensor([2, 1, 0]))
    cache.keep_recent(2, 1, shift=True)
    cache.move(torch.where(cache.valid(), cache.positions + 3, -1))
    assert [x.data_ptr() for x in tensors()] == [x.data_ptr() for x in held]
    views = held[4:]
    assert held[1].tolist() == [3, 3, 3] and held[0][:, :3].tolist() == [[3, 4, 5]] * 3
    if block_size is None:
        assert torch.equal(views[1], cache.read(1, width=8)[0])  # the view shows the edited keys


@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@torch.no_grad()
def test_decoder_logits_on_paged_storage_equal_contiguous_bit_for_bit(store):
    cfg = {"vocab_size": 30, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 24}
    model = posenc.models.Decoder.from_hf_config(cfg, seed=0).double().eval()
    ids, mask = torch.tensor([[1, 2, 3, 4, 5], [0, 0, 6, 7, 8]]), torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    logits = []
    for block_size in (None, 2):
        cache = model.new_cache(2, 9, store=store, block_size=block_size)
        out = [model(ids, attention_mask=mask, cache=cache)]
        cache.reorder(torch.tensor([1, 1]))  # two samples of row 1
        out += [model(torch.tensor([[9], [10]]), cache=cache), model(torch.tensor([[11], [12]]), cache=cache)]
        cache.rollback(torch.tensor([1, 0]))
        out.append(model(torch.tensor([[13, 14], [15, 16]]), cache=cache))
        logits.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*logits))


@pytest.mark.parametrize("block_size", [None, 3])
def test_update_writes_then_reads_up_to_the_high_water_mark(block_size):
    """`update` (gpt-fast's form) == `write` then `read` over the host-side bound `read_width`, which equals the width."""
    cache, twin = filled(block_size, t=4), filled(block_size, t=4)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 2, 2, 4, generator=g, dtype=F64), torch.randn(3, 2, 2, 4, generator=g, dtype=F64)
    mask = torch.tensor([[True, True], [False, True], [True, True]])
    positions = torch.tensor([[4, 5], [0, 4], [6, 9]])
    got = cache.update(0, cache.reserve(positions, mask), k, v)
    twin.write(0, k, v, twin.reserve(positions, mask))
    expected = twin.read(0)
    assert cache.read_width == cache.width == 6 and got[0].shape == (3, 2, 6, 4)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    cache.rollback(torch.tensor([3, 1, 5]))
    assert cache.read_width == cache.width == 4  # an edit narrows the bound again


@pytest.mark.parametrize("policy", ["recompute", "rerotate", "freeze"])
@torch.no_grad()
def test_table_policies_on_paged_storage_equal_contiguous(policy):
    """Dynamic NTK crossing its L0 after a fork: each policy clears, re-rotates or keeps shared blocks alike."""
    cfg = {"vocab_size": 30, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 24, "max_position_embeddings": 6,
           "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    model = posenc.models.Decoder.from_hf_config(cfg, seed=0).double().eval()
    logits = []
    for block_size in (None, 2):
        cache = model.new_cache(2, 12, policy=policy, block_size=block_size)
        out = [model(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), cache=cache)]
        cache.reorder(torch.tensor([0, 0]))
        out += [model(torch.tensor([[t], [t + 1]]), cache=cache) for t in range(9, 15, 2)]  # lengths 5, 6, 7 > L0
        logits.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*logits))
    if policy == "recompute":  # and both equal a full forward of the whole row
        full = model(torch.tensor([[1, 2, 3, 4, 9, 11, 13]]))
        assert_close(logits[1][-1][0, -1], full[0, -1])
