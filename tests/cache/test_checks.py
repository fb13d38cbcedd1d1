"""cache/checks.py `check_model_cache` and the refusals that name their argument: a cache that does not fit the
model (dtype, device, layers, heads, head_dim), an empty or out-of-range `reorder` index, bad `copy_slots` places."""

import pytest
import torch

from posenc import PosencError
from posenc.cache import KVCache, check_model_cache
from posenc.cache.quant import QuantizedKVCache
from tests.helpers.cache_state import changed, dump


def cache(**kw):
    return KVCache(2, 2, 1, 4, 8, **kw)


def test_a_fitting_cache_passes():
    check_model_cache(cache(dtype=torch.float16), torch.float16, "cpu", 2, 1, 4)
    check_model_cache(QuantizedKVCache(2, 2, 1, 4, 8, kv_dtype="int4", dtype=torch.bfloat16), torch.bfloat16,
                      torch.device("cpu"), 2, 1, 4)


@pytest.mark.parametrize("args, named", [
    ((torch.float64, "cpu", 2, 1, 4), "dtype=torch.float64"),
    ((torch.float32, "meta", 2, 1, 4), "device=meta"),
    ((torch.float32, "cpu", 3, 1, 4), "layers=3"),
    ((torch.float32, "cpu", 2, 2, 4), "kv_heads=2"),
    ((torch.float32, "cpu", 2, 1, 6), "head_dim=6"),
])
def test_a_cache_that_does_not_fit_is_refused_naming_cache(args, named):
    with pytest.raises(PosencError, match=rf"^cache: expected a cache built for this model \({named}"):
        check_model_cache(cache(), *args)


def test_not_a_cache_is_refused():
    with pytest.raises(PosencError, match="^past: expected a posenc.cache.KVCache"):
        check_model_cache(object(), torch.float32, "cpu", 2, 1, 4, arg="past")


@pytest.mark.parametrize("index", [torch.tensor([], dtype=torch.long), torch.tensor([0, 2]), torch.tensor([-1, 0])])
@pytest.mark.parametrize("block_size", [None, 2])
def test_reorder_refuses_an_empty_or_out_of_range_index_by_name(index, block_size):
    c = cache(block_size=block_size)
    c.reserve(torch.tensor([[0, 1], [3, 4]]))
    before = dump(c)
    with pytest.raises(PosencError, match=r"^index: expected a non-empty 1-D integer tensor of rows in \[0, 2\)"):
        c.reorder(index)
    assert not changed(before, dump(c)) and c.batch_size == 2


@pytest.mark.parametrize("make", [lambda: cache(), lambda: cache(block_size=2),
                                  lambda: QuantizedKVCache(2, 2, 1, 4, 8, kv_dtype="int8", store="unrotated")])
@pytest.mark.parametrize("bad, arg", [((5, 0, 0, 0), "src_rows"), ((0, 8, 0, 0), "src_slots"),
                                      ((0, 0, -1, 0), "dst_rows"), ((0, 0, 0, -2), "dst_slots")])
def test_copy_slots_refuses_places_outside_the_store_by_name(make, bad, arg):
    store = make().stores[0]
    with pytest.raises(PosencError, match=rf"^{arg}: expected \[n\] integers"):
        store.copy_slots(*(torch.tensor([x]) for x in bad))
    with pytest.raises(PosencError, match="^dst_slots: expected .*four tensors of one length"):
        store.copy_slots(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([0, 1]))
