"""The Triton kernels against the reference, on CPU under the Triton interpreter (TRITON_INTERPRET=1).

Under the interpreter the arithmetic is numpy's float32 (no FMA) and bf16 is rounded by the kernel's own
round-to-nearest-even, so table-driven results must equal the reference bit for bit; on a GPU the
comparison uses the per-dtype tolerances (the compiler may fuse multiply-adds).
Small shapes only: the interpreter costs milliseconds per program instance.
"""

import os

import pytest
import torch

from tests.helpers.triton_interpret import interpreted, use_interpreter_without_a_gpu

use_interpreter_without_a_gpu()  # before the kernels are imported
triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch):
    """Kernels decorated in interpreter mode: another test (the doctests) may have imported them without it."""
    interpreted(monkeypatch)
    yield

from tests.helpers.tolerances import assert_close  # noqa: E402

from posenc import PosencError, Rope  # noqa: E402
from posenc.rope.scaling import YaRN  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = os.environ.get("TRITON_INTERPRET") == "1"
PAIRINGS = ["split_half", "interleaved", "interleaved_to_split_half"]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def same(got, expected):
    if EXACT:
        assert torch.equal(got, expected)
    else:
        assert_close(got, expected)


@pytest.mark.parametrize("head_dim,rotary_dim", [(80, 80), (32, 20)])
@pytest.mark.parametrize("pairing", PAIRINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_forward_matches_reference(head_dim, rotary_dim, pairing, dtype):
    rope = Rope(head_dim=head_dim, rotary_dim=rotary_dim, pairing=pairing)
    for t in (1, 11):
        q, k = randn(2, 17, t, head_dim, dtype=dtype, seed=t), randn(2, 3, t, head_dim, dtype=dtype, seed=t + 1)
        pos = torch.randint(0, 3000, (2, t), generator=torch.Generator().manual_seed(t)).to(DEVICE)
        expected = rope.apply(q, k, pos, impl="reference")
        q0 = q.clone()
        got = rope.apply(q, k, pos, impl="triton")
        assert torch.equal(q, q0)  # out of place leaves the inputs alone
        same(got[0], expected[0]), same(got[1], expected[1])
        assert torch.equal(got[0][..., rotary_dim:], q[..., rotary_dim:])  # pass-through bit-identical
        rope.apply_(q, k, pos, impl="triton")
        same(q, expected[0]), same(k, expected[1])


def test_triton_layouts_non_contiguous_and_mrope():
    rope = Rope(head_dim=32, rotary_dim=24)
    q = randn(2, 11, 70)[..., 3:67:2].transpose(0, 1)  # [11, 2, 32] "thd" view: heads outer, channel stride 2
    k = randn(11, 1, 32, seed=1)
    pos = torch.arange(11).to(DEVICE) * 7
    expected = rope.apply(q, k, pos, layout="thd", impl="reference")
    got = rope.apply(q, k, pos, layout="thd", impl="triton")
    same(got[0], expected[0]), same(got[1], expected[1])
    mrope = Rope(head_dim=32, mrope_section=(4, 6, 6))
    qb, kb = randn(1, 5, 2, 32), randn(1, 5, 1, 32, seed=2)  # "bthd"
    pos3 = torch.randint(0, 40, (3, 1, 5), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    expected = mrope.apply(qb, kb, pos3, layout="bthd", impl="reference")
    got = mrope.apply(qb, kb, pos3, layout="bthd", impl="triton")
    same(got[0], expected[0]), same(got[1], expected[1])


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_triton_backward_matches_reference_autograd(pairing):
    rope = Rope(head_dim=32, rotary_dim=20, pairing=pairing)
    pos = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = []
    for impl in ("reference", "triton"):
        q, k = randn(2, 3, 5, 32).requires_grad_(), randn(2, 1, 5, 32, seed=1).requires_grad_()
        q2, k2 = rope.apply(q, k, pos, impl=impl)
        torch.autograd.backward((q2, k2), (randn(2, 3, 5, 32, seed=2), randn(2, 1, 5, 32, seed=3)))
        grads.append((q.grad, k.grad))
    same(grads[1][0], grads[0][0]), same(grads[1][1], grads[0][1])


@pytest.mark.parametrize("precision", ["float32", "exact"])
def test_angles_computed_on_the_fly(precision):
    from posenc.kernels.triton_rope import rotate

    rope = Rope(head_dim=64, scaling=YaRN(factor=4.0, original_max_positions=256))  # attention factor != 1
    q, k = randn(1, 3, 9, 64), randn(1, 2, 9, 64, seed=1)
    pos = (torch.arange(9) * 501).to(DEVICE)
    expected = rope.apply(q, k, pos, precision=precision, impl="reference")
    inv, factor = rope.inv_freq()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rotate(q, k, q_out, k_out, inv.to(DEVICE), inv.to(DEVICE), pos, "split_half", angles=precision, factor=factor)
    assert_close(q_out, expected[0]), assert_close(k_out, expected[1])  # own cos/sin: within float32 rounding


def _sparse(shape, strides, dtype=torch.float32):
    """A view whose offsets pass 2**31 elements while each stride fits in int32 (8 GB of untouched virtual
    memory; only the pages of its own elements are written), or a skip where that cannot be reserved."""
    if torch.cuda.is_available():
        pytest.skip("8 GB of device memory")
    try:
        return torch.empty_strided(shape, strides, dtype=dtype)
    except (RuntimeError, MemoryError):
        pytest.skip("no 8 GB of virtual memory here")


def test_offsets_past_two_to_the_31_elements():
    # b * batch_stride = 2 * 2**30: overflows int32 offsets (a wrong address, here a crash) unless computed in int64
    rope, pos = Rope(head_dim=64), torch.tensor([5, 9])
    src, k = randn(3, 1, 2, 64), randn(3, 1, 2, 64, seed=1)
    expected = rope.apply(src, k, pos, impl="reference")
    q = _sparse((3, 1, 2, 64), (2**30, 128, 64, 1))
    q.copy_(src)
    k_in = k.clone()
    rope.apply_(q, k_in, pos, impl="triton")
    same(q.contiguous(), expected[0]), same(k_in, expected[1])


@pytest.mark.parametrize("with_table", [False, True])
def test_triton_in_place_on_a_tensor_saved_for_backward_raises(with_table):
    rope = Rope(head_dim=32, rotary_dim=24)
    table = rope.table(16, device=DEVICE) if with_table else None
    w = torch.randn(32, 32, device=DEVICE).requires_grad_()
    for which in ("q", "k"):
        q, k = torch.randn(1, 2, 3, 32, device=DEVICE), torch.randn(1, 2, 3, 32, device=DEVICE)
        y = (q if which == "q" else k) @ w  # autograd saved it
        rope.apply_(q, k, torch.arange(3, device=DEVICE), impl="triton", table=table)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_triton_gradients_with_a_table_equal_the_reference():
    # float64 gradcheck needs float64, which the Triton kernel does not take: the vector-Jacobian products
    # must equal the reference's autograd (the same rotation by -theta, float32 under the interpreter)
    rope = Rope(head_dim=32, pairing="interleaved")
    table = rope.table(64, device=DEVICE)
    pos = torch.tensor([[0, 9, 63], [5, 5, 1]], device=DEVICE)
    grads = []
    for impl in ("triton", "reference"):
        q = torch.randn(2, 2, 3, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE).requires_grad_()
        k = torch.randn(2, 1, 3, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE).requires_grad_()
        qo, ko = rope.apply(q, k, pos, impl=impl, table=table)
        (qo.pow(2).sum() + (ko * torch.arange(32.0, device=DEVICE)).sum()).backward()
        grads.append((q.grad, k.grad))
    for a, b in zip(*grads):
        assert_close(a, b)
