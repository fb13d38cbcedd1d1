"""Every implementation behaves like a torch op under autograd.

In place: a tensor that autograd saved for backward, rotated by `apply_`, makes that backward raise
("modified by an inplace operation"), exactly as `x.mul_(2)` does, whichever implementation wrote it
(the C kernel writes through ctypes, so posenc must tell autograd). Allocating: float64 gradcheck of
`apply` for every implementation that takes float64. (Triton's cases are in test_kernels_triton.py.)
"""

import pytest
import torch

from posenc import PosencError, Rope
from posenc.kernels import cpu, ops  # noqa: F401  (ops registers posenc::rope and posenc::rope_)

IMPLS = ["reference", "compiled"] + (["cpu"] if cpu.available() else [])
MODIFIED = "modified by an inplace operation"


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def torch_op_raises(saved: torch.Tensor, w: torch.Tensor) -> None:
    """The oracle: the same pattern with a torch in-place op raises; posenc's mutation must too."""
    y = saved @ w
    saved.mul_(1.0)
    with pytest.raises(RuntimeError, match=MODIFIED):
        y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS + [None])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("with_table", [False, True])
def test_in_place_rotation_of_a_tensor_saved_for_backward_raises(impl, layout, with_table):
    rope = Rope(head_dim=64, rotary_dim=48)
    shape = (2, 4, 5, 64) if layout == "bhtd" else (2, 5, 4, 64)
    w = randn(64, 64, seed=9).requires_grad_()
    torch_op_raises(randn(*shape), w)
    table = rope.table(32) if with_table else None
    for which in ("q", "k"):
        q, k = randn(*shape, seed=1), randn(*shape, seed=2)
        y = (q if which == "q" else k) @ w  # autograd saves q (or k) to compute w's gradient
        rope.apply_(q, k, torch.arange(5), layout=layout, impl=impl, table=table)
        with pytest.raises(RuntimeError, match=MODIFIED):
            y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS + [None])
def test_in_place_variants_raise(impl):
    rope = Rope(head_dim=32)
    w = randn(32, 32, seed=9).requires_grad_()
    pos = torch.arange(3)
    # a view of a saved buffer (q and k split from a fused projection): the base's counter moves
    qk = randn(1, 2, 3, 64)
    y = qk @ randn(64, 8).requires_grad_()
    rope.apply_(qk[..., :32], qk[..., 32:], pos, impl=impl)
    with pytest.raises(RuntimeError, match=MODIFIED):
        y.sum().backward()
    # under no_grad (a decode loop) the write still counts, as for torch's own in-place ops
    q, k = randn(1, 2, 3, 32), randn(1, 2, 3, 32, seed=1)
    y = q @ w
    with torch.no_grad():
        rope.apply_(q, k, pos, impl=impl)
    with pytest.raises(RuntimeError, match=MODIFIED):
        y.sum().backward()
    # a single token (the decode shape) and GQA
    q, k = randn(3, 8, 1, 32), randn(3, 2, 1, 32, seed=1)
    y = k @ w
    rope.apply_(q, k, torch.tensor([[4], [9], [0]]), impl=impl)
    with pytest.raises(RuntimeError, match=MODIFIED):
        y.sum().backward()


@pytest.mark.skipif(not cpu.available(), reason="no C compiler for the cpu kernel")
def test_the_in_place_custom_op_bumps_versions():
    rope = Rope(head_dim=16)
    q, k = randn(1, 2, 3, 16), randn(1, 2, 3, 16, seed=1)
    w = randn(16, 16, seed=2).requires_grad_()
    cos, sin = rope.cos_sin(torch.arange(3))
    y = q @ w
    torch.ops.posenc.rope_(q, k, cos.contiguous(), sin.contiguous(), torch.arange(3), "split_half", "cpu", "table", 1.0)
    with pytest.raises(RuntimeError, match=MODIFIED):
        y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS + [None])
def test_in_place_on_tensors_that_require_grad_gives_the_reference_gradient(impl):
    rope = Rope(head_dim=32, pairing="interleaved")
    x = randn(2, 3, 4, 32, dtype=torch.float64).requires_grad_()
    w = randn(32, 32, seed=3, dtype=torch.float64)
    grads = []
    for name in (impl, "reference"):
        x.grad = None
        q, k = x @ w, x * 2.0  # non-leaves that require grad: rotated out of place and copied back
        rope.apply_(q, k, torch.arange(4) + 7, impl=name)
        (q.sin().sum() + (k * k).sum()).backward()
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pairing", ["split_half", "interleaved", "interleaved_to_split_half"])
def test_gradcheck_float64(impl, pairing):
    rope = Rope(head_dim=12, rotary_dim=8, pairing=pairing)
    q = randn(1, 2, 3, 12, dtype=torch.float64).requires_grad_()
    k = randn(1, 1, 3, 12, seed=1, dtype=torch.float64).requires_grad_()
    pos = torch.tensor([0, 5, 300])
    assert torch.autograd.gradcheck(lambda a, b: rope.apply(a, b, pos, impl=impl), (q, k))
    table = rope.table(301)
    assert torch.autograd.gradcheck(lambda a, b: rope.apply(a, b, pos, impl=impl, table=table), (q, k))


@pytest.mark.parametrize("impl", IMPLS + [None])
@pytest.mark.parametrize("with_table", [False, True])
@pytest.mark.parametrize("which", ["q", "k"])
def test_in_place_on_an_inference_tensor_outside_inference_mode_is_refused(impl, with_table, which):
    # torch refuses x.mul_(2) on an inference tensor outside torch.inference_mode(); apply_ does too, by
    # name, for every impl, writing nothing; inside inference_mode it rotates as usual
    rope = Rope(head_dim=16)
    table = rope.table(40) if with_table else None
    with torch.inference_mode():
        made = {"q": torch.randn(1, 2, 3, 16), "k": torch.randn(1, 1, 3, 16)}
        other = torch.randn(3)
    plain = {"q": torch.randn(1, 2, 3, 16), "k": torch.randn(1, 1, 3, 16)}
    q, k = (made[n] if n == which else plain[n] for n in ("q", "k"))
    q0, k0, pos = q.clone(), k.clone(), torch.tensor([1, 5, 30])
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        other.mul_(2)  # torch's own rule
    with pytest.raises(PosencError, match=rf"^{which}: expected a tensor torch lets apply_ change \(an inference tensor"):
        rope.apply_(q, k, pos, impl=impl, table=table)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    want = rope.apply(q0, k0, pos, impl="reference")
    with torch.inference_mode():
        rope.apply_(q, k, pos, impl=impl, table=table)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
