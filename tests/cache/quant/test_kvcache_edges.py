"""QuantizedKVCache: no re-quantization on the unrotated store, refusals that change nothing, bytes, the decoder."""

import pytest
import torch

import posenc
from posenc.cache.quant import QuantizedKVCache, cache_bytes_per_token
from posenc.models import Decoder
from tests.models.test_decoder import config

ROPE = posenc.Rope(head_dim=8)


def filled(fmt="int4", store="unrotated", n=11, group=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = QuantizedKVCache(2, 2, 3, 8, 16, kv_dtype=fmt, rope=ROPE, store=store, group=group)
    for t in (n - 1, 1):  # a prefill, then one streamed token
        slots = cache.reserve(cache.next_positions()[:, None] + torch.arange(t))
        for layer in range(2):
            cache.write(layer, torch.randn(2, 3, t, 8, generator=gen) * 3, torch.randn(2, 3, t, 8, generator=gen), slots)
    return cache


def snapshot(cache):
    """Every tensor the stores hold, plus the bookkeeping, cloned."""
    out = [cache.positions, cache.lengths, cache.tokens, cache.table_len]
    for store in cache.k + cache.v:
        out += [t for t in vars(store).values() if isinstance(t, torch.Tensor)]
    return [t.clone() for t in out]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_unrotated_codes_are_bit_identical_across_move_shift_rollback(fmt):
    cache = filled(fmt)
    w = cache.width
    before = [store.read(w) for store in cache.k]  # decoded unrotated keys [b, hk, w, d]
    codes = [store.codes.clone() for store in cache.k]
    cache.move(torch.where(cache.valid(), cache.positions * 3 + 5, -1))
    cache.keep_recent(window=w, sinks=0, shift=True)  # keeps everything, shifts positions back to contiguous
    assert cache.positions[0, :w].tolist() == list(range(5, 5 + w))
    cache.retable(torch.tensor([100, 100]))
    for store, old, old_codes in zip(cache.k, before, codes):
        assert torch.equal(store.codes, old_codes)
        assert torch.equal(store.read(w), old)
    cache.rollback(3)
    for store, old in zip(cache.k, before):
        assert torch.equal(store.read(w - 3), old[:, :, :w - 3])
    cache.keep_recent(window=2, sinks=2, shift=True)  # drops middle slots: codes move, values do not change
    for store, old in zip(cache.k, before):
        kept = torch.cat((old[:, :, :2], old[:, :, w - 5:w - 3]), dim=2)
        assert torch.equal(store.read(4), kept)


def test_rotated_store_re_quantizes_on_move():
    """The contrast: per-token keys stored after RoPE must be decoded, rotated and re-encoded."""
    cache = filled("int4", "rotated")
    codes = cache.k[0].codes.clone()
    cache.move(torch.where(cache.valid(), cache.positions + 7, -1))
    assert not torch.equal(cache.k[0].codes, codes)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(kv_dtype="int3"), "kv_dtype"), (dict(kv_dtype=None), "kv_dtype"),
    (dict(kv_dtype="int4", head_dim=7), "head_dim"), (dict(kv_dtype="int4", value_dim=5), "value_dim"),
    (dict(group=0), "group"), (dict(capacity=0), "capacity")])
def test_constructor_refuses_by_name(kwargs, arg):
    args = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, capacity=4) | kwargs
    with pytest.raises(posenc.PosencError, match=f"^{arg}: expected"):
        QuantizedKVCache(**args)


@pytest.mark.parametrize("store", ["unrotated", "rotated"])
def test_refused_writes_change_nothing(store):
    cache = filled("int8", store, n=6)
    slots = cache.reserve(cache.next_positions()[:, None] + torch.arange(2))
    before = snapshot(cache)
    k, v = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)
    with pytest.raises(posenc.PosencError, match="^v: expected finite values"):
        cache.write(0, k, v.clone().fill_(1e6), slots)
    with pytest.raises(posenc.PosencError, match="^k: expected finite values"):
        cache.write(1, k.clone().fill_(float("nan")), v, slots)
    with pytest.raises(posenc.PosencError, match="^k: expected shape"):
        cache.write(0, k[..., :6], v, slots)
    assert same(snapshot(cache), before)
    if store == "unrotated":  # per-channel blocks fill in slot order: a slot written out of order is refused
        with pytest.raises(posenc.PosencError, match="^slots: expected row 0's next slots"):
            cache.write(0, k, v, slots.flip(1))
        assert same(snapshot(cache), before)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "bfloat16", "float32"])
@pytest.mark.parametrize("store", ["unrotated", "rotated"])
def test_bytes_per_token_match_the_stores(fmt, store):
    n = 16  # a multiple of the group: every block full
    cache = QuantizedKVCache(3, 1, 2, 8, n, kv_dtype=fmt, rope=ROPE, store=store, group=4)
    slots = cache.reserve(torch.arange(n)[None])
    for layer in range(3):
        cache.write(layer, torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), slots)
    assert cache.nbytes == cache_bytes_per_token(fmt, 3, 2, 8, store=store, group=4) * n


def test_decoder_with_a_float32_store_is_bit_identical_and_int8_is_close():
    m = Decoder.from_hf_config(config("default"), seed=0)
    ids = torch.randint(0, m.embed_tokens.num_embeddings, (2, 12), generator=torch.Generator().manual_seed(1))

    def run(**kw):
        cache = m.new_cache(2, 12, **kw)
        return torch.cat([m(ids[:, :8], cache=cache), m(ids[:, 8:10], cache=cache),
                          m(ids[:, 10:11], cache=cache), m(ids[:, 11:], cache=cache)], dim=1)
    with torch.no_grad():
        full = m(ids)
        for store in ("rotated", "unrotated"):
            assert torch.equal(run(store=store, kv_dtype="float32"), run(store=store))
            assert isinstance(m.new_cache(1, 4, store=store, kv_dtype="int8"), QuantizedKVCache)
            gap = (run(store=store, kv_dtype="int8") - full).abs().max()
            assert 0 < gap < 0.05 * full.abs().max()
    with pytest.raises(posenc.PosencError, match="^kv_dtype: expected"):
        m.new_cache(1, 4, kv_dtype="int2")
