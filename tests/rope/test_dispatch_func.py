"""RoPE under torch.func transforms (vmap, grad): the default implementation runs the reference there (a C
kernel cannot read a wrapped tensor's memory), value checks still refuse bad positions by name, and results
equal a loop of plain calls (vmap) or autograd (grad)."""

import warnings

import pytest
import torch
from tests.kernels.test_cpu import randn

from posenc import PosencError, Rope

ROPE = Rope(head_dim=16, rotary_dim=12, pairing="interleaved")
POS = torch.tensor([1, 5, 30])


def loop(fn, xs):
    return torch.stack([fn(x) for x in xs])


@pytest.mark.parametrize("table", [None, ROPE.table(40)], ids=["no-table", "table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vmap_over_q_k_or_positions_equals_a_loop(table, dtype):
    q, k = randn(4, 1, 2, 3, 16, dtype=dtype), randn(4, 1, 1, 3, 16, dtype=dtype, seed=1)
    ps = torch.stack([POS, POS + 1, POS + 7, POS + 2])  # [4, 3]
    cases = [
        (lambda x: ROPE.apply(x, k[0], POS, table=table)[0], q),  # over q
        (lambda x: ROPE.apply(q[0], x, POS, table=table)[1], k),  # over k
        (lambda p: ROPE.apply(q[0], k[0], p, table=table)[0], ps),  # over positions
        (lambda x: ROPE.rotate(x, POS, table=table), q),
    ]
    for fn, xs in cases:
        want = loop(lambda x: fn(x), xs)  # plain tensors: the C kernel
        assert torch.equal(torch.func.vmap(fn)(xs), want)
    want = loop(lambda x: ROPE.apply(x, k[0], POS, impl="reference")[0], q)
    assert torch.equal(want, loop(lambda x: ROPE.apply(x, k[0], POS)[0], q))  # the loop is the reference


def test_vmap_in_place_equals_a_loop():
    q, k = randn(4, 1, 2, 3, 16), randn(4, 1, 1, 3, 16, seed=1)
    want_q = loop(lambda x: ROPE.apply(x, k[0], POS)[0], q)

    def step(x):
        x = x.clone()
        ROPE.apply_(x, k[0].clone(), POS, table=ROPE.table(40))
        return x

    assert torch.equal(torch.func.vmap(step)(q), want_q)


def test_grad_equals_autograd():
    q, k, w = randn(1, 2, 3, 16, dtype=torch.float64), randn(1, 1, 3, 16, dtype=torch.float64, seed=1), randn(1, 2, 3, 16, dtype=torch.float64, seed=2)
    for table in (None, ROPE.table(40)):
        g = torch.func.grad(lambda x: (ROPE.apply(x, k, POS, table=table)[0] * w).sum())(q)
        x = q.clone().requires_grad_()
        (ROPE.apply(x, k, POS, impl="reference")[0] * w).sum().backward()
        assert torch.equal(g, x.grad)


def test_bad_positions_and_named_kernels_are_refused_under_vmap():
    q, k = randn(1, 2, 3, 16), randn(1, 1, 3, 16, seed=1)
    bad = torch.stack([POS, POS.clone().index_fill_(0, torch.tensor([1]), 40)])
    with pytest.raises(PosencError, match=r"^position_ids: expected positions in \[0, 40\) \(the rows of the table\), "
                       r"got other values \(under a torch.func transform\)"):
        torch.func.vmap(lambda p: ROPE.apply(q, k, p, table=ROPE.table(40))[0])(bad)
    with pytest.raises(PosencError, match=r"^position_ids: expected positions >= 0"):
        torch.func.vmap(lambda p: ROPE.apply(q, k, p)[0])(torch.stack([POS, -POS]))
    with pytest.raises(PosencError, match=r"^impl: expected 'reference' or None under a torch.func transform"):
        torch.func.vmap(lambda x: ROPE.apply(x, k, POS, impl="cpu")[0])(q[None])


def test_vmap_through_attention_with_rope():
    from posenc.attention import attention

    q, k, v, pos = randn(3, 1, 2, 5, 16), randn(1, 2, 5, 16, seed=1), randn(1, 2, 5, 16, seed=2), torch.arange(5) + 9
    for table in (None, ROPE.table(40)):
        fn = lambda x: attention(x, k, v, encoding=ROPE, q_positions=pos, k_positions=pos, impl="sdpa", table=table)
        with warnings.catch_warnings():  # torch may warn that its CPU flash kernel has no batching rule
            warnings.simplefilter("ignore", UserWarning)
            assert torch.equal(torch.func.vmap(fn)(q), loop(fn, q))
