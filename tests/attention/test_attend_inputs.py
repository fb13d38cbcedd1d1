"""`attention`'s inputs: k, v and key masks unlike q, and flex with gradients on CPU, refused by name."""

import pytest
import torch

import posenc
from posenc import PosencError
from posenc.attention import attention
from posenc.models import Decoder


def tiny_decoder(**kw):
    return Decoder(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8, **kw)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])


@pytest.mark.parametrize("bad", ["v_dtype", "k_dtype", "v_meta", "mask_meta"])


def test_attention_refuses_k_v_and_key_mask_unlike_q(impl, bad):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 3, dtype=torch.bool)
    arg = {"v_dtype": "v", "k_dtype": "k", "v_meta": "v", "mask_meta": "key_mask"}[bad]
    if bad == "v_dtype":
        v = v.half()
    elif bad == "k_dtype":
        k = k.float()
    elif bad == "v_meta":
        v = v.to("meta")
    else:
        mask = mask.to("meta")
    with pytest.raises(PosencError, match=rf"^{arg}: expected .*(as q|on cpu)"):
        attention(q, k, v, q_positions=torch.arange(3), k_positions=torch.arange(3), key_mask=mask, impl=impl,
                  encoding=posenc.Rope(head_dim=4))


def test_flex_attention_with_grad_on_cpu_is_refused_by_name():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    pos = torch.arange(4)
    with pytest.raises(PosencError, match=r"impl: expected 'eager' or 'sdpa' when q, k or v require grad on cpu"):
        attention(q, q, q, q_positions=pos, k_positions=pos, impl="flex")
    with torch.no_grad():  # torch refuses a leaf that requires grad even here: so does posenc, by name
        with pytest.raises(PosencError, match=r"impl: expected 'eager' or 'sdpa'"):
            attention(q, q, q, q_positions=pos, k_positions=pos, impl="flex")
    x = q.detach()  # forward-only flex still runs
    want = attention(x, x, x, q_positions=pos, k_positions=pos, impl="eager")
    torch.testing.assert_close(attention(x, x, x, q_positions=pos, k_positions=pos, impl="flex"), want)
    model = tiny_decoder(attn_impl="flex")
    with pytest.raises(PosencError, match=r"attn_impl: expected 'eager' or 'sdpa' when q, k or v require grad"):
        model(torch.tensor([[1, 2, 3]]))
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 8)
