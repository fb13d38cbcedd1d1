"""ChannelStore rollback is exact with respect to the kept tokens: a per-channel (pre-RoPE) quantized cache rolled
back into its last filled block reads bit for bit as a cache that never saw the rolled-back tokens, then and after
more appends (speculative decoding's rejected drafts leave no trace). Oracle: that second cache."""

import pytest
import torch

from posenc import Rope
from posenc.cache.quant import QuantizedKVCache

B, HK, D, CAP, G = 2, 2, 4, 40, 4


def make(kv_dtype):
    return QuantizedKVCache(1, B, HK, D, CAP, kv_dtype=kv_dtype, group=G, rope=Rope(head_dim=D), store="unrotated")


def append(cache, k, v, counts):
    """Append `counts[r]` tokens per row (left padding) taken from the fronts of `k[r]`, `v[r]` (lists of [HK, D])."""
    t = max(counts)
    if t == 0:
        return
    last = cache.next_positions() - 1
    positions = torch.zeros(B, t, dtype=torch.long)
    mask = torch.zeros(B, t, dtype=torch.bool)
    keys, values = torch.zeros(B, HK, t, D), torch.zeros(B, HK, t, D)
    for r, n in enumerate(counts):
        for j in range(n):
            at = t - n + j
            positions[r, at], mask[r, at] = int(last[r]) + 1 + j, True
            keys[r, :, at], values[r, :, at] = k[r][j], v[r][j]
    slots = cache.reserve(positions, mask)
    cache.write(0, keys, values, slots)


def same(a, b):
    w = int(a.lengths.max())
    assert a.lengths.tolist() == b.lengths.tolist() and torch.equal(a.positions, b.positions)
    ka, va = a.read(0, width=w)
    kb, vb = b.read(0, width=w)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert torch.equal(a.k[0].read(w), b.k[0].read(w))  # the stored (unrotated) keys as well


def tokens(gen, n):
    return [torch.randn(HK, D, generator=gen) * (1 + 3 * torch.rand(HK, D, generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("lengths, back", [((4, 7), (1, 3)), ((8, 9), (4, 5)), ((10, 5), (6, 1)), ((12, 4), (4, 4))])
def test_rollback_into_the_last_filled_block_equals_never_seeing_the_tokens(kv_dtype, lengths, back):
    gen = torch.Generator().manual_seed(sum(lengths) + sum(back))
    k = [tokens(gen, n + 6) for n in lengths]
    v = [tokens(gen, n + 6) for n in lengths]
    rolled, fresh = make(kv_dtype), make(kv_dtype)
    append(rolled, k, v, [n - 2 for n in lengths])  # chunks of different sizes in the two caches
    append(rolled, [x[n - 2:] for x, n in zip(k, lengths)], [x[n - 2:] for x, n in zip(v, lengths)], [2, 2])
    rolled.rollback(torch.tensor(back))
    kept = [n - m for n, m in zip(lengths, back)]
    append(fresh, k, v, kept)
    same(rolled, fresh)
    more = [3, 5]  # then the same new tokens to both: the reopened block fills as the fresh one does
    k_new = [tokens(gen, n) for n in more]
    v_new = [tokens(gen, n) for n in more]
    append(rolled, k_new, v_new, more)
    append(fresh, k_new, v_new, more)
    same(rolled, fresh)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_speculative_decoding_leaves_no_trace_of_rejected_drafts(kv_dtype):
    gen = torch.Generator().manual_seed(0)
    spec, oracle = make(kv_dtype), make(kv_dtype)
    for step in range(9):
        draft_k, draft_v = [tokens(gen, 3) for _ in range(B)], [tokens(gen, 3) for _ in range(B)]
        append(spec, draft_k, draft_v, [3, 3])
        accepted = [int(a) for a in torch.randint(0, 4, (B,), generator=gen)]
        spec.rollback(torch.tensor([3 - a for a in accepted]))
        append(oracle, draft_k, draft_v, accepted)
        same(spec, oracle)


def test_a_rollback_past_the_raw_window_keeps_the_cut_blocks_codes():
    """Deeper than the last 2 * group appended slots no raw value is left: the cut block stays encoded (its
    statistics include the dropped tokens) and reads as before the rollback."""
    gen = torch.Generator().manual_seed(1)
    cache = make("int8")
    k, v = [tokens(gen, 14) for _ in range(B)], [tokens(gen, 14) for _ in range(B)]
    append(cache, k, v, [14, 14])  # raw window: slots 6..13; blocks [0, 4) [4, 8) [8, 12) encoded
    before = cache.k[0].read(14)
    cache.rollback(9)  # keep 5 slots: block [4, 8) is cut at slot 5, below the window
    assert torch.equal(cache.k[0].read(5), before[:, :, :5])
    assert (cache.k[0].block[:, 4] >= 0).all()  # still encoded


def test_a_forked_row_rolled_back_into_a_shared_block_leaves_its_twin_as_it_was():
    """Beam search: row 1 forks row 0 (they share block ids), then row 1 drops 2 tokens of the shared last block:
    row 1 reads as never having seen them, row 0 keeps its codes, and both keep appending exactly."""
    gen = torch.Generator().manual_seed(2)
    k, v = [tokens(gen, 9)] * B, [tokens(gen, 9)] * B
    forked, fresh = make("int4"), make("int4")
    append(forked, k, v, [9, 0])
    forked.reorder(torch.tensor([0, 0]))
    before = forked.k[0].read(9)[0]
    forked.rollback(torch.tensor([0, 3]))  # row 1 keeps 6 of 9: block [4, 8) is cut, blocks are shared
    append(fresh, k, v, [9, 6])
    same(forked, fresh)
    assert torch.equal(forked.k[0].read(9)[0], before)
    more_k, more_v = [tokens(gen, 5) for _ in range(B)], [tokens(gen, 5) for _ in range(B)]
    append(forked, more_k, more_v, [5, 5])
    append(fresh, more_k, more_v, [5, 5])
    same(forked, fresh)
