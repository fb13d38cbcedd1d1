"""`kernels.angles`: the cos/sin rows of a few positions in one C call, against torch's own float32 formula
(`float(p) * freq`, then `torch.cos` / `torch.sin`, times the factor), bit for bit; and the path's own guards
(the probe refuses functions that are not torch's; without it every caller still gets torch's bits)."""

import ctypes

import pytest
import torch

from posenc import PosencError, Rope
from posenc.kernels import angles, build

RUN = angles.entry()
needs_run = pytest.mark.skipif(RUN is None, reason="no C angles here (no kernel build, or a torch without MKL)")


def torch_formula(pos, freq, factor):
    theta = pos[..., None] * freq  # [..., r/2]: int64 x float32 -> float32, as checkpoints compute it
    cos, sin = torch.cos(theta), torch.sin(theta)
    return (cos * factor, sin * factor) if factor != 1.0 else (cos, sin)


def ladder(half, base=10000.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    inv = base ** (-torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))
    return inv * (1 + torch.rand(half, generator=g) * 1e-3)  # not a closed form: every bit of it is used


@needs_run
@pytest.mark.parametrize("half", [1, 3, 16, 35, 64])
@pytest.mark.parametrize("factor", [1.0, 1.2079441541679836, 0.5])
def test_rows_are_torch_bits_at_every_magnitude(half, factor):
    g = torch.Generator().manual_seed(half)
    freq = ladder(half)
    for pos in (torch.tensor([0]), torch.tensor([4095]), torch.arange(-7, 29),
                torch.randint(0, 2**53, (300,), generator=g), torch.randint(2**20, 2**25, (33, 1), generator=g),
                torch.randint(-(2**31), 2**31, (3, 5), generator=g)):
        got = angles.cos_sin(RUN, pos, freq, factor, -(2**53), 2**53)
        expected = torch_formula(pos, freq, factor)
        assert got[0].shape == (*pos.shape, half) and got[0].dtype == torch.float32
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@needs_run
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("factor", [1.0, 1.2079441541679836])
def test_rows_are_torch_bits_on_every_thread_count(threads, factor):
    # sines and cosines on different threads, tokens cut into ranges: 1024 angles or more (here 37 x 35 and
    # 301 x 35, odd so that no range is a round share), one thread below that (3 x 35)
    g = torch.Generator().manual_seed(threads)
    freq = ladder(35)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for pos in (torch.randint(0, 2**30, (37,), generator=g), torch.randint(-(2**20), 2**40, (301,), generator=g),
                    torch.tensor([5, 0, 4095])):
            got = angles.cos_sin(RUN, pos, freq, factor, -(2**53), 2**53)
            expected = torch_formula(pos, freq, factor)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (threads, pos.numel())
    finally:
        torch.set_num_threads(before)


@needs_run
def test_a_position_out_of_range_gives_none():
    freq = ladder(4)
    assert angles.cos_sin(RUN, torch.tensor([3, -1, 2]), freq, 1.0, 0, 2**53) is None
    assert angles.cos_sin(RUN, torch.tensor([2**53 + 1]), freq, 1.0, -(2**53), 2**53) is None
    assert angles.cos_sin(RUN, torch.tensor([-5]), freq, 1.0, -(2**53), 2**53) is not None


@needs_run
def test_the_probe_refuses_functions_that_are_not_torchs():
    fn, vcos, vsin, fresh, local = RUN
    assert angles._probe(RUN)
    assert not angles._probe((fn, vsin, vcos, fresh, local))  # cos and sin swapped: the probe sees it
    mkl = ctypes.CDLL(angles._torch_cpu_library())
    other = ctypes.cast(mkl.vmsExp, ctypes.c_void_p).value  # a vector function of the same shape, not cos
    assert not angles._probe((fn, other, vsin, fresh, local))


@pytest.mark.skipif(build.loaded() is None or not torch.backends.mkl.is_available(),
                    reason="no kernel build or a torch without MKL: the C angles are off by design")
def test_the_c_angles_are_on_where_torch_has_mkl():
    # the C side calls torch's own vmsCos / vmsSin, so its probe passes wherever they exist; a C side that
    # stops giving torch's bits is refused by the probe, and must fail here rather than skip every test above
    assert RUN is not None


def test_no_c_angles_without_the_kernel_or_mkl(monkeypatch):
    angles.entry.cache_clear()
    try:
        monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
        assert angles.entry() is None
        angles.entry.cache_clear()
        monkeypatch.undo()
        monkeypatch.setattr(build, "loaded", lambda: None)
        assert angles.entry() is None
    finally:
        monkeypatch.undo()
        angles.entry.cache_clear()


@pytest.mark.parametrize("c_angles", [True, False], ids=["c-angles", "torch-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_paths_give_the_references_bits(monkeypatch, c_angles, dtype):
    if c_angles and RUN is None:
        pytest.skip("no C angles here")
    if not c_angles:
        monkeypatch.setattr(angles, "entry", lambda: None)
    from posenc.rope.scaling import YaRN

    for rope in (Rope(head_dim=64), Rope(head_dim=48, rotary_dim=32, pairing="interleaved",
                                         scaling=YaRN(factor=4.0, original_max_positions=512))):
        g = torch.Generator().manual_seed(0)
        for shape in ((5, 1), (1, 3), (3,), (2, 3)):  # [b, 1] decode, [1, t], [t], [b, t]
            b, t = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
            pos = torch.randint(0, 9000, shape, generator=g)
            q = torch.randn(b, 4, t, rope.head_dim, generator=g).to(dtype)
            k = torch.randn(b, 2, t, rope.head_dim, generator=g).to(dtype)
            expected = rope.apply(q, k, pos, impl="reference")
            got = rope.apply(q, k, pos)
            qi, ki = q.clone(), k.clone()
            rope.apply_(qi, ki, pos)
            for out in (got, (qi, ki)):
                assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
            cos, sin = rope.cos_sin(pos)
            inv, factor = rope.angle_freq()
            assert all(torch.equal(a, e) for a, e in zip((cos, sin), torch_formula(pos, inv, factor)))
        with pytest.raises(PosencError, match="^position_ids: expected positions >= 0"):
            rope.apply_(q, k, -pos)
