"""The decode hot path: repeated `Rope.apply(_)` calls reading a held `RopeTable` (`table=`).

Every call must equal the reference bit for bit on its own data and positions; a position outside the table,
a negative one, another device or a table of another Rope is refused by name with nothing written.
"""

import threading

import pytest
import torch
from tests.kernels.test_cpu import randn

from posenc import PosencError, Rope
from posenc.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the cpu kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_repeated_decode_steps_equal_reference_on_fresh_data_and_positions(dtype, layout):
    rope = Rope(head_dim=80, rotary_dim=48, pairing="interleaved")
    shape = (3, 5, 1, 80) if layout == "bhtd" else (3, 1, 5, 80)
    table = rope.table(4100)
    alive = []
    for step in range(6):  # same metadata every step, new tensors and new positions
        q, k = randn(*shape, dtype=dtype, seed=step), randn(*shape, dtype=dtype, seed=step + 50)
        pos = torch.tensor([[7 + step * 13], [0], [4000 + step]])  # [b, 1]
        alive.append(pos)  # every step's positions at a new address
        expected = rope.apply(q, k, pos, layout=layout, impl="reference")
        q0 = q.clone()
        out = rope.apply(q, k, pos, layout=layout, table=table)
        assert torch.equal(q, q0), "apply mutated q"
        qi, ki = q.clone(), k.clone()
        res = rope.apply_(qi, ki, pos, layout=layout, table=table)
        assert res[0] is qi and res[1] is ki
        for got in (out, (qi, ki), rope.apply(q, k, pos, layout=layout)):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), step


def test_position_beyond_the_held_table_is_refused_and_nothing_written():
    rope = Rope(head_dim=64, base=5e5)
    table = rope.table(4096)
    q, k = randn(2, 4, 1, 64, seed=1), randn(2, 2, 1, 64, seed=2)
    for p in (5, 4095, 4096, 70_000, 7):
        pos = torch.tensor([p])
        expected = rope.apply(q, k, pos, impl="reference")
        assert all(torch.equal(a, b) for a, b in zip(rope.apply(q, k, pos), expected)), p  # no table: any position
        qi, ki = q.clone(), k.clone()
        if p < 4096:
            rope.apply_(qi, ki, pos, table=table)
            assert torch.equal(qi, expected[0]) and torch.equal(ki, expected[1]), p
            continue
        for impl in (None, "cpu", "reference"):
            with pytest.raises(PosencError, match=r"^position_ids: expected positions in \[0, 4096\) \(the rows of"):
                rope.apply_(qi, ki, pos, table=table, impl=impl)
            assert torch.equal(qi, q) and torch.equal(ki, k), (p, impl)  # nothing written


def test_negative_positions_raise_with_and_without_a_table():
    rope = Rope(head_dim=64)
    q, k = randn(1, 2, 1, 64), randn(1, 2, 1, 64)
    table = rope.table(16)
    qi, ki = q.clone(), k.clone()
    with pytest.raises(PosencError, match="position_ids"):
        rope.apply_(qi, ki, torch.tensor([-2]))
    with pytest.raises(PosencError, match=r"position_ids: expected positions in \[0, 16\)"):
        rope.apply_(qi, ki, torch.tensor([-2]), table=table)
    assert torch.equal(qi, q) and torch.equal(ki, k)  # nothing written
    got = rope.apply(q, k, torch.tensor([-2]), allow_negative=True)
    expected = rope.apply(q, k, torch.tensor([-2]), allow_negative=True, impl="reference")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_metadata_is_checked_on_every_call():
    rope = Rope(head_dim=64)
    q, k, pos = randn(1, 2, 1, 64), randn(1, 2, 1, 64), torch.tensor([3])
    rope.apply_(q, k, pos)
    rope.apply_(q, k, pos)
    with pytest.raises(PosencError, match="last dim = head_dim"):
        rope.apply_(randn(1, 2, 1, 32), randn(1, 2, 1, 32), pos)
    with pytest.raises(PosencError, match="integer"):
        rope.apply_(q, k, torch.tensor([3.0]))
    with pytest.raises(PosencError, match="position_ids"):
        rope.apply_(q, k, torch.tensor([3, 4]))  # two positions for one token
    q32 = randn(1, 2, 1, 64, seed=3).to(torch.int32)
    with pytest.raises(PosencError, match="q"):
        rope.apply_(q32, q32.clone(), pos)


@pytest.mark.parametrize("inplace", [True, False])
def test_k_on_another_device_is_refused(inplace):
    # a meta k has no data (data_ptr 0): the kernel must never be handed it in place of a CPU tensor
    rope = Rope(head_dim=64)
    q, k, pos = randn(2, 3, 1, 64), randn(2, 3, 1, 64, seed=1), torch.tensor([9])
    fn = rope.apply_ if inplace else rope.apply
    k_meta = torch.empty(2, 3, 1, 64, device="meta")
    with pytest.raises(PosencError, match=r"^k: expected a tensor on the device of q \(cpu\), got .* on meta$"):
        fn(q, k_meta, pos)
    q0 = q.clone()
    with pytest.raises(PosencError, match="device of q"):
        fn(q, k_meta, pos, table=rope.table(16))
    assert torch.equal(q, q0)  # nothing written


def test_autograd_with_a_table_takes_the_differentiable_path():
    rope = Rope(head_dim=64)
    q, k, pos = randn(2, 3, 1, 64), randn(2, 3, 1, 64, seed=1), torch.tensor([9])
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    qr, kr = qg.detach().clone().requires_grad_(), kg.detach().clone().requires_grad_()
    out = rope.apply(qg, kg, pos, table=rope.table(16))
    ref = rope.apply(qr, kr, pos, impl="reference")
    assert out[0].requires_grad
    (out[0].sum() + 2 * out[1].sum()).backward()
    (ref[0].sum() + 2 * ref[1].sum()).backward()
    assert torch.equal(qg.grad, qr.grad) and torch.equal(kg.grad, kr.grad)


def test_threads_share_one_table():
    rope = Rope(head_dim=128)
    table = rope.table(3000)
    errors = []

    def worker(seed):
        for step in range(30):
            q, k = randn(4, 8, 1, 128, seed=seed * 100 + step), randn(4, 2, 1, 128, seed=seed * 100 + step + 1)
            pos = torch.tensor([seed * 1000 + step])
            expected = rope.apply(q, k, pos, impl="reference")
            rope.apply_(q, k, pos, table=table)
            if not (torch.equal(q, expected[0]) and torch.equal(k, expected[1])):
                errors.append((seed, step))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_other_position_dtypes_with_and_without_a_table(dtype):
    rope = Rope(head_dim=64)
    q, k = randn(2, 3, 1, 64), randn(2, 3, 1, 64, seed=1)
    pos = torch.tensor([[100], [7]], dtype=dtype)
    expected = rope.apply(q, k, pos.long(), impl="reference")
    for got in (rope.apply(q, k, pos), rope.apply(q, k, pos, table=rope.table(128))):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_non_contiguous_positions_are_read_through_their_strides():
    rope = Rope(head_dim=64)
    q, k = randn(2, 3, 1, 64), randn(2, 3, 1, 64, seed=1)
    for step in range(3):
        pos = torch.tensor([[5 + step, 99], [9 + step, 98]])[:, :1]  # [2, 1], strides (2, 1)
        expected = rope.apply(q, k, pos.contiguous(), impl="reference")
        for got in (rope.apply(q, k, pos), rope.apply(q, k, pos, table=rope.table(16))):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), step


@pytest.mark.parametrize("pairing", ["split_half", "interleaved"])
@pytest.mark.parametrize("head_dim", [48, 64, 80, 96, 128, 256])
def test_bf16_wide_rows_with_edge_values_are_bit_exact(head_dim, pairing):
    # 32 pairs per vector step (head_dim >= 64), then 16-pair steps, the last one masked (48: 16 + 8 pairs,
    # 80: 32 + 8): a NaN, a denormal or a denormal result anywhere in a step must send it through the
    # exact conversion; every other block takes the one-instruction one. Interleaved rows: 16 pairs per
    # step, and a step with such a lane hands the rest of the row to the exact scalar loop
    rope = Rope(head_dim=head_dim, pairing=pairing)
    vals = torch.tensor([1e-39, -1e-39, 3e-38, 2e-38, float("inf"), float("nan"), 1.0 + 2**-8, 1.0 + 3 * 2**-8,
                         3e38, 0.0, -0.0, -1.5])
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 12, 1, head_dim, generator=g)
    for h in range(12):  # head h: one edge value at a random channel, the rest ordinary
        q[:, h, 0, torch.randint(0, head_dim, (1,), generator=g)] = vals[h]
    q = torch.cat([q, torch.full((2, 1, 1, head_dim), 1e-39)], 1).to(torch.bfloat16)  # a head of denormals
    for p in (0, 1, 7, 4095):
        got = rope.apply(q, q, torch.tensor([p]))[0]
        expected = rope.apply(q, q, torch.tensor([p]), impl="reference")[0]
        nan = expected.isnan()
        assert torch.equal(got.isnan(), nan), p
        assert torch.equal(got.view(torch.int16)[~nan], expected.view(torch.int16)[~nan]), p


def test_in_place_refuses_q_and_k_sharing_memory_and_keeps_split_views():
    # apply_(x, x) would rotate x twice: refused, before and after a call like it was recorded
    rope, pos = Rope(head_dim=8), torch.arange(3)
    x = randn(2, 4, 3, 8)
    y = randn(2, 3, 4, 8)  # bthd memory
    qkv = randn(2, 4, 3, 24)  # a fused projection's output
    refused = {
        "same tensor": (x, x),
        "overlapping heads": (x[:, :3], x[:, 1:]),
        "overlapping channels of one buffer": (qkv[..., :8], qkv[..., 4:12]),
        "bthd overlapping heads": (y[:, :, :3].transpose(1, 2), y[:, :, 1:].transpose(1, 2)),
    }
    for name, (q, k) in refused.items():
        before = x.clone(), y.clone(), qkv.clone()
        with pytest.raises(PosencError, match="k: expected a tensor that shares no memory with q"):
            rope.apply_(q, k, pos)
        assert all(torch.equal(a, b) for a, b in zip(before, (x, y, qkv))), name  # nothing written
    repeats = {  # a tensor whose own elements meet is named itself
        "q": (randn(1, 4, 3, 8).expand(2, 4, 3, 8), randn(2, 4, 3, 8)),  # broadcast
        "k": (randn(2, 4, 3, 8), x.flatten().as_strided((2, 4, 3, 8), (96, 24, 4, 1))),  # rows meet
    }
    for arg, (q, k) in repeats.items():
        for table in (None, rope.table(8)):
            before = x.clone()
            with pytest.raises(PosencError, match=f"^{arg}: expected a tensor whose elements are distinct memory"):
                rope.apply_(q, k, pos, table=table)
            assert torch.equal(x, before), arg
    q, k = randn(2, 4, 3, 8), randn(2, 4, 3, 8, seed=1)
    x0 = x.clone()
    with pytest.raises(PosencError, match="shares no memory"):
        rope.apply_(x, x, pos, table=rope.table(8))
    assert torch.equal(x, x0)
    # disjoint views of one buffer (a fused qkv projection split; heads of one tensor) rotate as copies do
    for q, k in [qkv.split(8, -1)[:2], (x[:, :2], x[:, 2:]), (y[:, :, :2].transpose(1, 2), y[:, :, 2:].transpose(1, 2))]:
        expected = rope.apply(q.clone(), k.clone(), pos, impl="reference")
        for table in (None, rope.table(8)):
            q_in, k_in = q.clone(), k.clone()
            buf = q._base if q._base is not None else q
            snapshot = buf.clone()
            rope.apply_(q, k, pos, table=table)
            assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])
            buf.copy_(snapshot)  # back to the inputs for the second round
            assert torch.equal(q, q_in) and torch.equal(k, k_in)


def test_in_place_on_a_leaf_that_requires_grad_is_refused_by_name():
    rope, pos = Rope(head_dim=8), torch.arange(3)
    q, k = randn(2, 4, 3, 8).requires_grad_(), randn(2, 4, 3, 8)
    with pytest.raises(PosencError, match=r"^q: expected a tensor autograd lets apply_ change"):
        rope.apply_(q, k, pos)
    with pytest.raises(PosencError, match=r"^k: expected a tensor autograd lets apply_ change"):
        rope.apply_(k, q, pos)
    with torch.no_grad():  # no graph: in place is fine
        rope.apply_(q, k, pos)
    q2 = q * 1.0  # not a leaf: recorded by autograd
    out = rope.apply_(q2, k.clone(), pos)
    assert out[0] is q2 and q2.grad_fn is not None


@pytest.mark.parametrize("pairing", ["split_half", "interleaved"])
@pytest.mark.parametrize("head_dim", [48, 80, 128])
def test_float16_rows_with_edge_values_are_bit_exact(head_dim, pairing):
    # the float16 rows use the hardware conversions: denormals, the largest finite value (rotations
    # overflow past it), halfway cases, infinities and NaN must round as the reference's conversion does
    rope = Rope(head_dim=head_dim, pairing=pairing)
    vals = torch.tensor([6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, float("inf"),
                         float("nan"), 0.0, -0.0, 3e-5])
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 12, 1, head_dim, generator=g)
    for h in range(12):
        q[:, h, 0, torch.randint(0, head_dim, (3,), generator=g)] = vals[h]
    q = torch.cat([q, torch.full((2, 1, 1, head_dim), 6e-8)], 1).to(torch.float16)  # a head of denormals
    k = q.flip(1).contiguous()
    bits = q.view(torch.int16).clone(), k.view(torch.int16).clone()
    for p in (0, 1, 7, 4095):
        pos = torch.tensor([p])
        expected = rope.apply(q, k, pos, impl="reference")
        qi, ki = q.clone(), k.clone()
        for got in (rope.apply(q, k, pos), rope.apply_(qi, ki, pos)):
            for g_, e in zip(got, expected):
                nan = e.isnan()
                assert torch.equal(g_.isnan(), nan), p
                assert torch.equal(g_.view(torch.int16)[~nan], e.view(torch.int16)[~nan]), p
        assert torch.equal(q.view(torch.int16), bits[0]) and torch.equal(k.view(torch.int16), bits[1])  # apply: inputs kept
