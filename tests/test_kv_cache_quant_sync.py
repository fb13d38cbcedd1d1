"""QuantizedKVCache's append path makes no host sync, and its refusals still name the argument.

The guard of tests/test_no_host_sync.py makes `.item()`, `.tolist()`, `bool()`, `int()`, `float()` and
`__index__` of a tensor raise while `update` runs: a prefill with left padding, then decode steps. The same
sequence run outside the guard, on a twin cache, is the reference (bit-identical reads). The range check is
on the device now (`errors.assert_values`): on the CPU a value beyond float16's range, NaN or inf still raises
PosencError naming `k` or `v` before anything is written.
"""

import pytest
import torch

import posenc
from posenc.kv_cache_quant import QuantizedKVCache
from test_kv_cache_quant_edges import same, snapshot
from test_no_host_sync import no_host_sync

LAYERS, B, HK, D, CAP, GROUP = 2, 3, 2, 8, 24, 4
ROPE = posenc.Rope(head_dim=D)
SYNC_FREE = [("rotated", f) for f in ("float32", "bfloat16", "float16", "int8", "int4", "fp8")] + \
            [("unrotated", f) for f in ("float32", "bfloat16", "float16")]
CHECKED = [(s, f) for s, f in SYNC_FREE if f not in ("float32", "bfloat16")]  # float16 scales or a float16 cast


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
    got = run(cache, plan, no_host_sync)
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
