"""`apply_rope` and `Rope.apply`'s inputs: tables, layouts and tensor kinds, refused by name where they cannot be
rotated."""

import pytest
import torch

import posenc
from posenc import PosencError, Rope, apply_rope
from posenc.attention import attention


def test_apply_rope_refuses_an_integer_sin_table():
    """rope/apply.py `check_table`: mutant dropping `check_float_tensor("sin", sin)` rotated by an integer table."""
    x = torch.ones(1, 1, 2, 4)
    cos, sin = Rope(head_dim=4).cos_sin(torch.arange(2))
    with pytest.raises(PosencError, match=r"^sin: expected a floating-point dtype.*dtype torch\.int64$"):
        apply_rope(x, cos, sin.long())
    with pytest.raises(PosencError, match=r"^sin: expected a floating-point torch\.Tensor, got list$"):
        apply_rope(x, cos, sin.tolist())


def test_layout_td_is_one_sequence_of_one_head():
    """rope/apply.py LAYOUTS["td"] = (2, ...), mutant 2 -> 3: `[t, d]` input (one head, no batch) is accepted."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen)
    cos, sin = Rope(head_dim=8).cos_sin(torch.arange(3, 8))  # [5, 4]
    got = apply_rope(x, cos, sin, layout="td")
    assert got.shape == (5, 8)
    assert torch.equal(got, apply_rope(x[None, None], cos, sin)[0, 0])  # the bhtd result of the same head
    with pytest.raises(PosencError, match=r"^x: expected a tensor of rank 2"):
        apply_rope(x[None], cos, sin, layout="td")


def test_sparse_q_or_k_is_refused_by_name():
    # a sparse tensor has no memory for the kernel to read (it raised torch's "Cannot access data pointer")
    rope = posenc.Rope(head_dim=64)
    q, k, pos = torch.randn(2, 4, 3, 64), torch.randn(2, 2, 3, 64), torch.tensor([[0, 1, 2], [5, 6, 7]])
    for table in (rope.table(100), None):
        for arg, (a, b) in (("q", (q.to_sparse(), k)), ("k", (q, k.to_sparse()))):
            with pytest.raises(PosencError, match=rf"^{arg}: expected a dense tensor \(layout torch.strided\), got a "
                               r"tensor of layout torch.sparse_coo"):
                rope.apply(a, b, pos, table=table)
    with pytest.raises(PosencError, match=r"^q: expected a dense tensor"):
        attention(q.to_sparse(), k, k, q_positions=torch.arange(3), k_positions=torch.arange(3))
