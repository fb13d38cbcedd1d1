"""A refused `Decoder.forward` with a cache leaves the cache bit-identical and names the argument: a key beyond
the quantized format's range in the second layer (after the first layer's write), a cache of another dtype,
device or shape than the model. The oracle is the tests' own dump of the whole cache state."""

import pytest
import torch

import posenc
from posenc import PosencError
from posenc.cache import KVCache
from posenc.models import Decoder
from tests.helpers.cache_state import changed, dump, held

D = 4


def tiny(num_layers=2):
    torch.manual_seed(0)
    return Decoder(vocab_size=11, hidden_size=8, num_layers=num_layers, num_heads=2, intermediate_size=8,
                   encoding=posenc.Rope(head_dim=D))


def refused(call, cache, arg):
    before, ids = dump(cache), held(cache)
    with pytest.raises(PosencError, match=rf"^{arg}\b"):
        call()
    assert held(cache) == ids and not changed(before, dump(cache))


@pytest.mark.parametrize("kv_dtype, store", [("int8", "unrotated"), ("int4", "rotated"), ("fp8", "unrotated")])
def test_a_key_out_of_the_formats_range_in_layer_one_changes_nothing(kv_dtype, store):
    model = tiny()
    cache = model.new_cache(batch_size=2, capacity=16, store=store, kv_dtype=kv_dtype)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        model(ids, cache=cache)
        want = model(torch.tensor([[7], [8]]), cache=cache)  # the step that will be refused, on a copy below
    cache = model.new_cache(batch_size=2, capacity=16, store=store, kv_dtype=kv_dtype)
    with torch.no_grad():
        model(ids, cache=cache)
        weight = model.layers[1].self_attn.k_proj.weight
        saved = weight.clone()
        weight.mul_(1e7)  # layer 1's keys beyond float16: every scaled format refuses them, layer 0 is written
        refused(lambda: model(torch.tensor([[7], [8]]), cache=cache), cache, "k")
        weight.copy_(saved)
        got = model(torch.tensor([[7], [8]]), cache=cache)  # no phantom slot: the step runs as if never refused
    assert torch.equal(got, want)


@pytest.mark.parametrize("block_size", [None, 4])
def test_a_cache_of_another_dtype_is_refused_before_anything_moves(block_size):
    model = tiny()
    cache = KVCache(2, 1, model.num_kv_heads, D, 8, rope=model.rope, dtype=torch.float64, block_size=block_size)
    slots = cache.reserve(torch.tensor([[0]]))
    for layer in range(2):
        cache.write(layer, torch.ones(1, model.num_kv_heads, 1, D, dtype=torch.float64),
                    torch.ones(1, model.num_kv_heads, 1, D, dtype=torch.float64), slots)
    with torch.no_grad():
        refused(lambda: model(torch.tensor([[3]]), cache=cache), cache, "cache")
    with pytest.raises(PosencError, match="dtype=torch.float32"):
        model(torch.tensor([[3]]), cache=cache)


@pytest.mark.parametrize("kw", [dict(num_layers=3), dict(head_dim=6)])
def test_a_cache_of_another_shape_is_refused_by_name(kw):
    model = tiny()
    layers, d = kw.get("num_layers", 2), kw.get("head_dim", D)
    cache = KVCache(layers, 1, model.num_kv_heads, d, 8, rope=None)
    with torch.no_grad():
        refused(lambda: model(torch.tensor([[3]]), cache=cache), cache, "cache")
