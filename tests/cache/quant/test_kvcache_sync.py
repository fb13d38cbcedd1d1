"""QuantizedKVCache's append path makes no host sync, and its refusals still name the argument.

The guard of tests/test_no_host_sync.py makes `.item()`, `.tolist()`, `bool()`, `int()`, `float()` and
`__index__` of a tensor raise while `update` runs: a prefill with left padding, then decode steps. A second
guard (`no_sync` adds a TorchDispatchMode) refuses the aten ops that wait for an accelerator even when
called from C++: scalar reads, `nonzero`, boolean-mask indexing, `unique`, `equal`, ... The same sequence run
outside the guards, on a twin cache, is the reference (bit-identical reads). The range check is on the device
(`errors.assert_values`): on the CPU a value beyond float16's range, NaN or inf still raises PosencError
naming `k` or `v` before anything is written. A decoder's decode step over a per-channel int4 cache traces
under `torch.compile(fullgraph=True)` (a graph break, i.e. a sync, raises) and equals eager bit for bit. The
per-channel store's vectorized write is checked against `formats.encode` of each block of a row's tokens
(bit-exact codes and statistics), and it refuses by name a direct write out of slot order.
"""

import contextlib

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch.utils._python_dispatch import TorchDispatchMode

import posenc
from posenc.cache.quant import QuantizedKVCache
from posenc.cache.quant.formats import encode, kv_format
from posenc.cache.quant.store import RESIDUAL, QuantStore
from tests.cache.quant.test_kvcache_edges import same, snapshot
from tests.test_no_host_sync import no_host_sync

LAYERS, B, HK, D, CAP, GROUP = 2, 3, 2, 8, 24, 4
ROPE = posenc.Rope(head_dim=D)
SYNC_FREE = [("rotated", f) for f in ("float32", "bfloat16", "float16", "int8", "int4", "fp8")] + \
            [("unrotated", f) for f in ("float32", "bfloat16", "float16", "int8", "int4", "fp8")]
CHECKED = [(s, f) for s, f in SYNC_FREE if f not in ("float32", "bfloat16")]  # float16 scales or a float16 cast


SYNCING = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2",
           "unique_dim", "unique_consecutive", "repeat_interleave", "bincount"}


class _RefuseSyncingOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        by_mask = name.startswith(("index", "_index_put")) and len(args) > 1 and isinstance(args[1], (list, tuple)) \
            and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])  # nonzero inside
        if name in SYNCING or by_mask:
            raise AssertionError(f"device sync: aten.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_sync():
    """`no_host_sync` plus every aten op that makes an accelerator wait (seen at the dispatcher)."""
    with no_host_sync(), _RefuseSyncingOps():
        yield


def test_the_dispatch_guard_catches_syncs_made_in_cpp():
    x = torch.arange(4)
    for call in (lambda: x[x > 1], lambda: torch.unique(x), lambda: torch.equal(x, x), lambda: x.nonzero(),
                 lambda: x.sum().item()):
        with pytest.raises(AssertionError, match="sync"), no_sync():
            call()


def steps(seed=0):
    """A left-padded prefill of 7 (rows of 7, 5 and 2 tokens), then decode steps of 1, 1, 3 and 1 tokens."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([7, 5, 2])
    mask = torch.arange(7)[None, :] >= (7 - lens)[:, None]  # [b, 7] left padding
    out = [(torch.arange(7)[None, :].expand(B, 7) - (7 - lens)[:, None], mask)]
    for t in (1, 1, 3, 1):
        out.append((None, torch.ones(B, t, dtype=torch.bool)))
    return [(p, m, torch.randn(LAYERS, B, HK, m.shape[1], D, generator=gen) * 4,
             torch.randn(LAYERS, B, HK, m.shape[1], D, generator=gen)) for p, m in out]


def run(cache, plan, guard):
    """Reserve and `update` every layer for each step of `plan`; return every (keys, values) read."""
    reads = []
    for positions, mask, k, v in plan:
        if positions is None:
            positions = cache.next_positions()[:, None] + torch.arange(mask.shape[1])  # [b, t]
        with guard():
            slots = cache.reserve(positions, mask)
            for layer in range(LAYERS):
                reads.append(cache.update(layer, slots, k[layer], v[layer]))
    return reads


def make(store, fmt):
    return QuantizedKVCache(LAYERS, B, HK, D, CAP, kv_dtype=fmt, rope=ROPE, store=store, group=GROUP)


@pytest.mark.parametrize("store,fmt", SYNC_FREE)
@torch.no_grad()
def test_update_makes_no_host_sync(store, fmt):
    plan = steps()
    want = run(make(store, fmt), plan, lambda: torch.no_grad())  # no guard: the reference
    cache = make(store, fmt)
    got = run(cache, plan, no_sync)
    assert len(got) == len(want) == LAYERS * len(plan)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert gk.shape == wk.shape and torch.equal(gk, wk) and torch.equal(gv, wv)
    assert cache.lengths.tolist() == [13, 11, 8]
    assert cache.read_width == 13 and got[-1][0].shape == (B, HK, 13, D)


@pytest.mark.parametrize("store,fmt", CHECKED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 65505.0])
def test_a_refused_update_raises_by_name_and_writes_nothing(store, fmt, bad):
    cache = make(store, fmt)
    run(cache, steps()[:2], lambda: torch.no_grad())
    slots = cache.reserve(cache.next_positions()[:, None])
    k, v = torch.randn(B, HK, 1, D), torch.randn(B, HK, 1, D)
    before = snapshot(cache)
    # a whole row: a rotated key keeps at least one channel of each pair at >= |bad|
    for arg, kk, vv in (("k", k.clone().index_fill_(0, torch.tensor([1]), bad), v),
                        ("v", k, v.clone().index_fill_(0, torch.tensor([1]), bad))):
        with pytest.raises(posenc.PosencError, match=f"^{arg}: expected finite values within"):
            cache.update(1, slots, kk, vv)
        assert same(snapshot(cache), before)
    cache.update(1, slots, k, v)  # the same call with good values goes through
    assert not same(snapshot(cache), before)


@st.composite
def appends(draw):
    """Steps of `[b, t]` masks: each row some tokens (0..7) at random places among t columns (the rest padding)."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        t = draw(st.integers(1, 9))
        out.append(torch.tensor([draw(st.lists(st.booleans(), min_size=t, max_size=t)) for _ in range(B)]))
    return out


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@settings(max_examples=15, deadline=None)
@given(masks=appends(), seed=st.integers(0, 2**16))
def test_per_channel_appends_encode_each_block_once_like_kv_quant(fmt, masks, seed):
    """Oracle: `encode` of each row's tokens `[g * j, g * (j + 1))` (bit-exact codes and statistics, one id per
    block, every id distinct), the tail as written in the residual; sync-free whatever the padding."""
    gen = torch.Generator().manual_seed(seed)
    cap = sum(m.shape[1] for m in masks)
    cache = QuantizedKVCache(1, B, HK, D, cap, kv_dtype=fmt, rope=ROPE, store="unrotated", group=GROUP)
    raw = [[] for _ in range(B)]
    for mask in masks:
        k = torch.randn(B, HK, mask.shape[1], D, generator=gen) * 5
        positions = cache.next_positions()[:, None] + torch.arange(mask.shape[1])
        with no_sync():
            slots = cache.reserve(positions, mask)
            cache.update(0, slots, k, torch.randn(B, HK, mask.shape[1], D, generator=gen))
        for r in range(B):
            raw[r] += [k[r, :, j] for j in range(mask.shape[1]) if mask[r, j]]
    ids = blocks_match_encode(cache.k[0], raw, fmt, cap)
    assert len(set(ids)) == len(ids) == int(cache.k[0].next_block)


def blocks_match_encode(store, raw, fmt, cap):
    """Assert each row's full blocks are `encode` of its raw tokens `raw[r]` (list of `[h, d]`), bit-exact codes
    and statistics under one id, the tail in the residual, the rest empty; return every block's id."""
    ids = []
    for r, tokens in enumerate(raw):
        n, blocks = len(tokens), len(tokens) // GROUP
        for j in range(blocks):
            want = encode(torch.stack(tokens[j * GROUP:(j + 1) * GROUP], 1), fmt, "channel")  # [h, g, .]
            got = store.codes[r, :, j * GROUP:(j + 1) * GROUP]
            assert torch.equal(got, want.codes.view(torch.uint8) if fmt == "fp8" else want.codes)
            block = store.block[r, j * GROUP:(j + 1) * GROUP]
            assert bool((block == block[0]).all()) and 0 <= int(block[0]) < int(store.next_block)
            assert torch.equal(store.scale[int(block[0])], want.scale[:, 0])
            assert want.offset is None or torch.equal(store.offset[int(block[0])], want.offset[:, 0])
            ids.append(int(block[0]))
        for s in range(blocks * GROUP, n):
            assert int(store.block[r, s]) == RESIDUAL and torch.equal(store.residual[r, :, s % (2 * GROUP)], tokens[s])
        assert bool((store.block[r, n:cap] == -1).all())
    return ids


@pytest.mark.parametrize("index", [[0, 1, 1, 0, 1], [1]], ids=["fork-to-5-rows", "drop-to-1-row"])
def test_per_channel_rows_forked_or_dropped_fill_to_capacity_without_a_sync(index):
    """After a reorder to another batch size (forks share block ids) every row appends up to the capacity under
    the sync guards: the pool was sized at the reorder; each row's blocks are `encode` of its own tokens."""
    cap, gen = 14, torch.Generator().manual_seed(3)
    cache = QuantizedKVCache(1, 2, HK, D, cap, kv_dtype="int4", rope=ROPE, store="unrotated", group=GROUP)
    k = torch.randn(2, HK, 5, D, generator=gen) * 5
    cache.update(0, cache.reserve(torch.arange(5).expand(2, 5)), k, k)  # a block and one residual token per row
    raw = [[k[r, :, j] for j in range(5)] for r in index]
    cache.reorder(torch.tensor(index))
    b = len(index)
    for t in (1, 3, 2, 3):  # 9 more tokens per row: 14, the capacity
        new = torch.randn(b, HK, t, D, generator=gen) * 5
        with no_sync():
            slots = cache.reserve(cache.next_positions()[:, None] + torch.arange(t))
            cache.update(0, slots, new, new)
        for r in range(b):
            raw[r] += [new[r, :, j] for j in range(t)]
    ids = blocks_match_encode(cache.k[0], raw, "int4", cap)
    assert len(set(ids)) == len(ids) - (b - len(set(index)))  # forks share their first block only
    assert int(cache.k[0].next_block) <= cache.k[0].pool


def test_a_direct_store_write_out_of_order_is_refused_by_name():
    store = QuantStore(2, HK, 6, D, fmt=kv_format("int8"), group=GROUP, key_axis="channel")
    store.write(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), torch.randn(3, HK, D), torch.randn(3, HK, D))
    before = [t.clone() for part in (store.keys, store.values) for t in vars(part).values()
              if isinstance(t, torch.Tensor)]
    for rows, slots, message in (([0, 1], [3, 1], "row 0's next slots in order, from 2"),
                                 ([1, 1], [2, 1], "row 1's next slots in order, from 1"),
                                 ([0, 0, 0, 0, 0], [2, 3, 4, 5, 6], "row 0's next slots in order, from 2, below "
                                                                    "capacity 6")):
        with pytest.raises(posenc.PosencError, match=f"^slots: expected {message}"):
            store.write(torch.tensor(rows), torch.tensor(slots), torch.randn(len(rows), HK, D), None)
    after = [t for part in (store.keys, store.values) for t in vars(part).values() if isinstance(t, torch.Tensor)]
    assert same(after, before)
    store.write(torch.tensor([1, 0, 0]), torch.tensor([1, 2, -1]), torch.randn(3, HK, D), None)  # in order: taken
    assert store.keys.block[:2, :3].tolist() == [[RESIDUAL] * 3, [RESIDUAL] * 2 + [-1]]


@torch.no_grad()
def test_a_compiled_decode_step_over_per_channel_int4_keys_is_one_graph_and_exact():
    from posenc.models import Decoder
    from tests.models.test_decoder_compile import CFG, PROMPT, PROMPT_MASK

    model = Decoder.from_hf_config({**CFG, "num_hidden_layers": 1}, seed=0).eval()
    caches = [QuantizedKVCache(1, 2, model.num_kv_heads, model.head_dim, 12, kv_dtype="int4", rope=model.rope,
                               store="unrotated", group=3) for _ in range(2)]
    for cache in caches:  # rows of 4 and 3 tokens: blocks fill at different steps
        model(PROMPT, attention_mask=PROMPT_MASK, cache=cache)
    torch._dynamo.reset()
    compiled = torch.compile(lambda tok, cache: model(tok, cache=cache), fullgraph=True, backend="aot_eager")
    for i in range(4):
        tok = torch.tensor([[7 + i], [11 + i]])
        assert torch.equal(compiled(tok, caches[0]), model(tok, cache=caches[1]))
    assert all(torch.equal(a, b) for a, b in zip(caches[0].k[0].read(), caches[1].k[0].read()))
    assert int(caches[0].k[0].next_block) == int(caches[1].k[0].next_block) == 4  # 8 and 7 tokens: 2 + 2 blocks
