"""The decoder's attention implementations (eager / sdpa / flex) and its growable KV cache.

Oracle: the eager implementation (plain softmax over explicit logical-position masks) and a full forward
over the whole sequence; each batch row must also equal its run alone. Float64, TOL[float64] = 1e-10.
"""

import pytest
import torch

import posenc
from posenc.bias import ALiBi
from posenc.models import Decoder
from tests.helpers.tolerances import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

CFG = {"model_type": "llama", "vocab_size": 40, "hidden_size": 36, "num_hidden_layers": 3,
       "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 44, "rms_norm_eps": 1e-6,
       "max_position_embeddings": 64}


def make(impl="sdpa", windows=(None, 3, None), encoding=None):
    model = Decoder.from_hf_config(CFG, seed=0, attn_impl=impl, encoding=encoding).double().eval()
    model.layer_windows = windows  # one sliding layer: a second mask per forward
    return model


def ids(shape, seed=1):
    return torch.randint(0, 40, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl, scheme", [("sdpa", "rope"), ("sdpa", "alibi"), ("flex", "rope")])  # flex: ~0.3 s a call
def test_impls_equal_eager_full_padded_and_cached(impl, scheme):
    encoding = ALiBi(num_heads=6) if scheme == "alibi" else None
    eager, other = make("eager", encoding=encoding), make(impl, encoding=encoding)
    x = ids((3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    with torch.no_grad():
        want = eager(x, attention_mask=mask)
        assert_close(other(x, attention_mask=mask), want)
        for row, keep in enumerate(mask.bool()):  # each row equals its run alone
            assert_close(other(x[row:row + 1, keep])[0], want[row, keep])
        cache = other.new_cache(3)
        steps = [other(x[:, :5], attention_mask=mask[:, :5], cache=cache)]
        steps += [other(x[:, i:i + 1], attention_mask=mask[:, i:i + 1], cache=cache) for i in range(5, 9)]
    got = torch.cat(steps, 1)
    assert_close(got[mask.bool()], want[mask.bool()])


def test_impl_is_chosen_out_loud():
    model = make()
    assert model.attn_impl == "sdpa"  # the fast default
    model.attn_impl = "flex"
    assert model.attn_impl == "flex"
    with pytest.raises(posenc.PosencError, match=r"attn_impl: expected one of \('eager', 'sdpa', 'flex'\), got 'fa2'"):
        model.attn_impl = "fa2"
    with pytest.raises(posenc.PosencError, match=r"attn_impl: expected one of"):
        Decoder.from_hf_config(CFG, attn_impl=None)
    assert model.attn_impl == "flex"  # a refused value changes nothing


@torch.no_grad()
def test_a_row_that_sees_no_key_stays_finite_in_every_impl():
    """An all-padding row has no key to see (zeros inside attention): finite logits; the other row unchanged."""
    x, mask = ids((2, 6)), torch.tensor([[1] * 6, [0] * 6])
    for impl in ("eager", "sdpa", "flex"):
        out = make(impl)(x, attention_mask=mask)
        assert torch.isfinite(out).all(), impl
        assert_close(out[0], make("eager")(x[:1])[0])


# ------------------------------------------------------------------ growable cache
def test_growable_cache_doubles_and_equals_full_forward():
    model = make()
    x = ids((2, 140), seed=3)
    mask = torch.ones(2, 140, dtype=torch.long)
    mask[1, :9] = 0  # row 1 is 9 tokens shorter: its empty slots sit inside the read width
    with torch.no_grad():
        want = model(x, attention_mask=mask)
        cache = model.new_cache(2)  # capacity None: grows on demand
        assert cache.growable and cache.capacity == 64
        steps, capacities = [model(x[:, :70], attention_mask=mask[:, :70], cache=cache)], [cache.capacity]
        for i in range(70, 140):
            steps.append(model(x[:, i:i + 1], attention_mask=mask[:, i:i + 1], cache=cache))
            capacities.append(cache.capacity)
            empty = torch.arange(cache.capacity)[None, :] >= cache.lengths[:, None]  # [2, capacity]
            assert (cache.positions[empty] == -1).all() and (cache.tokens[empty] == -1).all()
    assert capacities[0] == 128 and sorted(set(capacities)) == [128, 256]  # max(need, 2 * capacity)
    assert cache.lengths.tolist() == [140, 131]
    assert_close(torch.cat(steps, 1)[mask.bool()], want[mask.bool()])


def test_grown_cache_keeps_rollback_reorder_and_keep_recent():
    model = make(windows=(None, None, None))
    x = ids((2, 80), seed=4)
    with torch.no_grad():
        cache = model.new_cache(2)
        model(x[:, :70], cache=cache)
        assert cache.capacity == 128
        cache.rollback(5)  # back to 65 tokens
        cache.reorder(torch.tensor([1, 0]))
        got = model(x[[1, 0], 65:80], cache=cache)
        assert_close(got, model(x[[1, 0], :80])[:, 65:])
        cache.keep_recent(window=10, sinks=2)
        assert cache.lengths.tolist() == [12, 12]
        assert cache.positions[0, :3].tolist() == [0, 1, 70] and cache.capacity == 128


def test_fixed_cache_says_how_to_size_it():
    model = make()
    cache = model.new_cache(1, capacity=8)
    model(ids((1, 6)), cache=cache)
    with pytest.raises(posenc.PosencError, match=r"input_ids: expected at most 2 new tokens in row 0 \(capacity 8, "
                                                 r"6 used\); size the cache .* new_cache\(batch_size, capacity=9\) or "
                                                 r"more, or capacity=None to grow on demand, got 3"):
        model(ids((1, 3)), cache=cache)
    assert cache.lengths.tolist() == [6]  # nothing changed


@pytest.mark.parametrize("capacity", [4, 7.0, True])
def test_grow_refuses_shrinking_or_non_integers(capacity):
    cache = make().new_cache(1, capacity=5)
    with pytest.raises(posenc.PosencError, match=r"capacity: expected an integer >= the current capacity 5"):
        cache.grow(capacity)
