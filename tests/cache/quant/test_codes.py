"""cache/quant/codes.py: code buffers (shape, dtype, int4 packing, fp8 bits) and regrowth keep what they hold."""

import pytest
import torch

from posenc.cache.quant.channels import ChannelStore
from posenc.cache.quant.codes import CodeStore, as_codes, code_bits, code_buffer, regrow
from posenc.cache.quant.formats import kv_format
from posenc.cache.quant.tokens import TokenStore


@pytest.mark.parametrize("name, dtype, width", [("int8", torch.uint8, 6), ("int4", torch.uint8, 3),
                                                ("fp8", torch.uint8, 6), ("bfloat16", torch.bfloat16, 6)])
def test_code_buffer_shape_and_dtype(name, dtype, width):
    buf = code_buffer(kv_format(name), 2, 3, 5, 6, None)
    assert buf.shape == (2, 3, 5, width) and buf.dtype == dtype and not buf.any()


def test_fp8_bits_round_trip():
    x = torch.tensor([0.5, -3.0, 448.0]).to(torch.float8_e4m3fn)
    bits = code_bits(x)
    assert bits.dtype == torch.uint8
    assert torch.equal(as_codes(kv_format("fp8"), bits).float(), x.float())
    ints = torch.arange(3, dtype=torch.uint8)
    assert code_bits(ints) is ints and as_codes(kv_format("int8"), ints) is ints


def test_regrow_keeps_filled_slots_and_fills_the_rest():
    t = torch.arange(2 * 1 * 4 * 2).view(2, 1, 4, 2)  # 3 slots + scratch
    out = regrow(t, 3, 5)
    assert out.shape == (2, 1, 6, 2)
    assert torch.equal(out[:, :, :3], t[:, :, :3]) and not out[:, :, 3:].any()
    ids = regrow(torch.zeros(2, 4, dtype=torch.int32), 3, 4, -1)
    assert ids.shape == (2, 5) and (ids[:, 3:] == -1).all() and (ids[:, :3] == 0).all()


@pytest.mark.parametrize("part", ["token", "channel"])
def test_both_parts_share_the_code_store_facts(part):
    fmt = kv_format("int4")
    store = (TokenStore(fmt, (2, 3, 7, 4), torch.float32, None) if part == "token"
             else ChannelStore(fmt, (2, 3, 7, 4), torch.float32, None, group=4))
    assert isinstance(store, CodeStore)
    assert store.capacity == 7 and store.shape == (2, 3, 7, 4) and store.device == torch.device("cpu")
    assert store.slot_index(torch.tensor([-1, 2])).tolist() == [7, 2]
