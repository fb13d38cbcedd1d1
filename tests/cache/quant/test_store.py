"""`posenc.cache.quant.store.QuantStore` keeps the `KVStore` contract: against `ContiguousStore` as the oracle.

A float32 cast store must read bit-identically to a `ContiguousStore` under any sequence of writes
(with padding), copies (compaction, clears, cross-row moves), reorders (forks) and growth. A per-channel
store moves codes and block ids, never re-encodes: after a compaction its read equals the same copies
applied to a `ContiguousStore` holding its decoded values before. Its statistics pool is reclaimed, so a
sliding window streams in constant memory. Cast formats keep the decode step free of host syncs.
"""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import posenc
from posenc.cache import BlockTable, ContiguousStore, KVCache, PagedStore
from posenc.cache.quant import QuantizedKVCache
from posenc.cache.quant.formats import kv_format
from posenc.cache.quant.store import RESIDUAL, QuantStore
from tests.test_no_host_sync import DECODER, no_host_sync

B, HK, D, DV, CAP = 3, 2, 4, 6, 5


def pair(fmt="float32", key_axis="token", group=4, cap=CAP):
    kw = dict(dtype=torch.float32)
    return (QuantStore(B, HK, cap, D, DV, fmt=kv_format(fmt), group=group, key_axis=key_axis, **kw),
            ContiguousStore(B, HK, cap, D, DV, **kw))


def distinct_slots(draw, n, b, cap):
    """`n` distinct (row, slot) places of `b` rows, some slots -1 (padding / dropped)."""
    places = draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(-1, cap - 1)), min_size=n, max_size=n,
                           unique_by=lambda p: p if p[1] >= 0 else object()))
    return torch.tensor([p[0] for p in places]), torch.tensor([p[1] for p in places])


@st.composite
def operations(draw):
    ops, b, cap = [], B, CAP
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["write", "write", "copy", "reorder", "grow"]))
        n = draw(st.integers(1, 6))
        if kind == "write":
            ops.append(("write", *distinct_slots(draw, n, b, cap), draw(st.booleans())))
        elif kind == "copy":
            rows, slots = distinct_slots(draw, n, b, cap)
            src = [draw(st.tuples(st.integers(0, b - 1), st.integers(-1, cap - 1))) for _ in range(n)]
            ops.append(("copy", torch.tensor([s[0] for s in src]), torch.tensor([s[1] for s in src]), rows, slots))
        elif kind == "reorder":
            index = draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=4))  # forks; b' may differ
            ops.append(("reorder", torch.tensor(index)))
            b = len(index)
        else:
            cap += draw(st.integers(0, 3))
            ops.append(("grow", cap))
    return ops


@settings(max_examples=40, deadline=None)
@given(ops=operations(), seed=st.integers(0, 2**16))
def test_a_float32_store_reads_exactly_like_the_contiguous_store(ops, seed):
    gen = torch.Generator().manual_seed(seed)
    stores = pair()
    for op in ops:
        if op[0] == "write":
            rows, slots, keys_only = op[1:]
            k, v = torch.randn(len(rows), HK, D, generator=gen), torch.randn(len(rows), HK, DV, generator=gen)
            for store in stores:
                store.write(rows, slots, k, None if keys_only else v)
        elif op[0] == "copy":
            for store in stores:
                store.copy_slots(*op[1:])
        elif op[0] == "reorder":
            for store in stores:
                store.reorder(op[1])
        else:
            for store in stores:
                store.grow(op[1])
        got, want = stores[0].read(), stores[1].read()
        assert stores[0].capacity == stores[1].capacity
        assert all(torch.equal(g, w) for g, w in zip(got, want))


STORES = {
    "contiguous": lambda cap: ContiguousStore(B, HK, cap, D, DV),
    "paged": lambda cap: PagedStore(BlockTable(B, cap, 3), cap, HK, D, DV),
    "float32": lambda cap: pair("float32", cap=cap)[0],
    "int8-token": lambda cap: pair("int8", cap=cap)[0],
    "int4-channel": lambda cap: pair("int4", "channel", group=3, cap=cap)[0],
}


@pytest.mark.parametrize("name", list(STORES))
def test_read_with_a_width_is_the_first_slots(name):
    """`read(w)` = the first w slots of `read()` for every w (0 and the capacity included); a float32 store's
    equal a ContiguousStore's (the oracle), a contiguous store's are views."""
    cap, gen = 8, torch.Generator().manual_seed(1)
    store, oracle = STORES[name](cap), ContiguousStore(B, HK, cap, D, DV)
    for lo, hi in ((0, 5), (5, 7)):  # every row appends: blocks and a residual for per-channel keys
        rows, slots = torch.arange(B).repeat_interleave(hi - lo), torch.arange(lo, hi).repeat(B)
        k, v = torch.randn(len(rows), HK, D, generator=gen), torch.randn(len(rows), HK, DV, generator=gen)
        for s in (store, oracle):
            s.write(rows, slots, k, v)
    full = store.read()
    for w in range(cap + 1):
        got = store.read(w)
        assert got[0].shape == (B, HK, w, D) and got[1].shape == (B, HK, w, DV)
        assert torch.equal(got[0], full[0][:, :, :w]) and torch.equal(got[1], full[1][:, :, :w])
        if name in ("contiguous", "paged", "float32"):
            assert all(torch.equal(g, o[:, :, :w]) for g, o in zip(got, oracle.read()))
        if name == "contiguous" and w:
            assert got[0].data_ptr() == full[0].data_ptr()  # a view: the store's own memory


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(0, 11), min_size=B, max_size=B), keep=st.lists(st.booleans(), min_size=11,
                                                                                    max_size=11))
def test_per_channel_compaction_moves_codes_without_re_encoding(fmt, lengths, keep):
    store, oracle = pair(fmt, "channel", group=4, cap=11)
    gen = torch.Generator().manual_seed(sum(lengths))
    raw = torch.zeros(B, HK, 11, D)  # the keys as written
    for r, n in enumerate(lengths):  # each row appends n tokens in two writes: blocks and a residual
        for lo, hi in ((0, n // 2), (n // 2, n)):
            keys = torch.randn(hi - lo, HK, D, generator=gen) * 3
            raw[r, :, lo:hi] = keys.transpose(0, 1)
            store.write(torch.full((hi - lo,), r), torch.arange(lo, hi), keys,
                        torch.randn(hi - lo, HK, DV, generator=gen))
    k, v = store.read()
    oracle.write(torch.arange(B).repeat_interleave(11), torch.arange(11).repeat(B), k.transpose(1, 2).flatten(0, 1),
                 v.transpose(1, 2).flatten(0, 1))
    filled = torch.arange(11)[None, :] < torch.tensor(lengths)[:, None]  # [b, cap]
    kept = filled & torch.tensor(keep)[None, :]
    order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)  # as posenc.cache.edit.keep
    src = order.masked_fill(~kept.gather(1, order), -1)  # [b, cap]
    rows = torch.arange(B).repeat_interleave(11)
    for s in (store, oracle):
        s.copy_slots(rows, src.flatten(), rows, torch.arange(11).repeat(B))
    # a kept prefix that cuts a row's last block reopens it (raw keys, as if the rest had never been written:
    # tests/cache/quant/test_channels.py); every other slot reads its codes as before
    reopened = (store.keys.block[:, None, :11, None] == RESIDUAL) & (src >= 0)[:, None, :, None]  # [b, 1, cap, 1]
    want_k = torch.where(reopened, raw.gather(2, src.clamp(min=0)[:, None, :, None].expand(B, HK, 11, D)),
                         oracle.read()[0])
    assert torch.equal(store.read()[0], want_k) and torch.equal(store.read()[1], oracle.read()[1])
    encoded = (store.keys.block[:, None, :11, None] >= 0).expand(B, HK, 11, D)  # slots in full blocks
    n = kept.sum(1)  # appending after the compaction continues each row's blocks (a residual may fill)
    room = n < 11  # a row that kept all 11 slots is full: the store writes each slot once, so it takes none
    store.write(torch.arange(B)[room], n[room], torch.randn(int(room.sum()), HK, D, generator=gen),
                torch.randn(int(room.sum()), HK, DV))
    assert torch.equal(store.read()[0][encoded], oracle.read()[0][encoded])
    assert bool((store.keys.block[:, :11] != -1).sum(1).eq(n + room.long()).all())


def test_a_sliding_window_streams_in_a_constant_pool():
    cache = QuantizedKVCache(1, 1, 2, 8, 16, kv_dtype="int8", rope=posenc.Rope(head_dim=8), store="unrotated",
                             group=4)
    gen = torch.Generator().manual_seed(0)
    pool = cache.k[0].scale.shape[0]
    for _ in range(200):  # 50 blocks' worth of tokens through a window of 8
        cache.keep_recent(window=7)
        w = int(cache.lengths[0])
        encoded = (cache.k[0].block[:, None, :w, None] >= 0).expand(1, 2, w, 8)  # slots in full blocks
        before = cache.k[0].read(w)[encoded]
        slots = cache.reserve(cache.next_positions()[:, None])
        cache.write(0, torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen), slots)
        assert torch.equal(cache.k[0].read(w)[encoded], before)  # reclaiming ids never changes a decoded key
    assert cache.k[0].next_block < 200 // 4 and cache.k[0].scale.shape[0] == pool  # ids were reclaimed


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@torch.no_grad()
def test_a_cast_cache_decode_step_makes_no_host_sync(kv_dtype, store):
    from posenc.models import Decoder

    model = Decoder.from_hf_config(DECODER, seed=0).eval()
    cache = model.new_cache(2, 9, store=store, kv_dtype=kv_dtype)
    model(torch.tensor([[3, 4, 5], [6, 7, 8]]), cache=cache)
    expected = model(torch.tensor([[11], [12]]), cache=cache)
    cache.rollback(1)
    with no_host_sync():
        got = model(torch.tensor([[11], [12]]), cache=cache)
    assert torch.equal(got, expected)


def test_custom_stores_are_contiguous_only():
    with pytest.raises(posenc.PosencError, match="^make_store: expected None with a block_size"):
        KVCache(1, 1, 1, 4, 8, block_size=4, make_store=ContiguousStore)
    from posenc.models import Decoder

    with pytest.raises(posenc.PosencError, match="^block_size: expected None with a kv_dtype"):
        Decoder.from_hf_config(DECODER, seed=0).new_cache(1, 8, block_size=4, kv_dtype="int8")
