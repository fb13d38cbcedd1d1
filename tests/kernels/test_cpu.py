"""The fast implementations (`impl="cpu"`, the default on CPU) against the reference rotation.

The reference (`impl="reference"`, plain torch) is itself checked against float64 2x2-matrix oracles in
test_rope_invariants.py; here every kernel must reproduce it bit for bit where the arithmetic is the same
(the C kernel: fp32 math, no FMA, one rounding), in place and allocating, forward and backward.
"""

import tempfile

import pytest
import torch
from tests.helpers.tolerances import assert_close
from tests.rope.test_apply_invariants import oracle, ref_inv_freq

import posenc
from posenc import PosencError, Rope
from posenc.kernels import angles, build, cpu
from posenc.rope import dispatch
from posenc.rope.scaling import DynamicNTK, YaRN

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the cpu kernel")

PAIRINGS = ["split_half", "interleaved", "interleaved_to_split_half"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# (head_dim, rotary_dim): round dims, an odd multiple of 16, and an odd rotary width (10 pairs) with pass-through
HEADS = [(64, 64), (80, 80), (96, 96), (128, 128), (256, 256), (32, 20)]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def both(rope, q, k, pos, **kw):
    """(allocating result, in-place result) of the default impl, checking identity and non-mutation."""
    q0, k0 = q.clone(), k.clone()
    out = rope.apply(q, k, pos, **kw)
    assert torch.equal(q, q0) and torch.equal(k, k0), "apply mutated its inputs"
    qi, ki = q.clone(), k.clone()
    res = rope.apply_(qi, ki, pos, **kw)
    assert res[0] is qi and res[1] is ki
    return out, (qi, ki)


@pytest.mark.parametrize("head_dim,rotary_dim", HEADS)
@pytest.mark.parametrize("pairing", PAIRINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_is_bit_exact_vs_reference(head_dim, rotary_dim, pairing, dtype):
    rope = Rope(head_dim=head_dim, rotary_dim=rotary_dim, pairing=pairing, base=5e5)
    for t in (1, 11, 217):
        q, k = randn(2, 17, t, head_dim, dtype=dtype, seed=t), randn(2, 3, t, head_dim, dtype=dtype, seed=t + 1)
        pos = torch.randint(0, 5000, (2, t), generator=torch.Generator().manual_seed(t))  # [b, t]
        expected = rope.apply(q, k, pos, impl="reference")
        for got in both(rope, q, k, pos, impl="cpu"):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (t, dtype)
            assert torch.equal(got[0][..., rotary_dim:], q[..., rotary_dim:])  # pass-through bit-identical


def test_cpu_matches_float64_oracle_directly():
    rope = Rope(head_dim=80, rotary_dim=20, pairing="interleaved")
    q, k = randn(1, 17, 11, 80, dtype=torch.float64), randn(1, 1, 11, 80, dtype=torch.float64)
    pos = torch.arange(11) * 97
    q2, k2 = rope.apply(q, k, pos, impl="cpu")
    inv = ref_inv_freq(1e4, 20)
    expected = oracle(q, pos, inv, "interleaved", angles=pos.float()[:, None] * inv)  # float32 angles
    assert_close(q2, expected, dtype=torch.float32)  # float32 tables meet float64 data (by design)


@pytest.mark.parametrize("layout", ["bhtd", "bthd", "thd"])
def test_layouts_and_long_sequence(layout):
    rope = Rope(head_dim=128)
    t = 2048 if layout == "bhtd" else 217
    shape = {"bhtd": (1, 4, t, 128), "bthd": (1, t, 4, 128), "thd": (t, 4, 128)}[layout]
    q, k = randn(*shape, dtype=torch.bfloat16), randn(*shape, dtype=torch.bfloat16, seed=1)
    pos = torch.arange(t) + 3
    expected = rope.apply(q, k, pos, layout=layout, impl="reference")
    for got in both(rope, q, k, pos, layout=layout):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_non_contiguous_inputs_in_place_and_allocating():
    rope = Rope(head_dim=64, rotary_dim=48)
    base_q = randn(2, 11, 6, 130)
    q = base_q[..., 1:129:2].transpose(1, 2)  # [2, 6, 11, 64], channel stride 2, heads/tokens swapped
    k = randn(2, 2, 11, 64)[:, :, ::1, :].transpose(2, 3).contiguous().transpose(2, 3)  # column-major rows
    pos = torch.arange(11)
    expected = rope.apply(q, k, pos, impl="reference")
    before = base_q.clone()
    (qa, ka), (qi, ki) = both(rope, q, k, pos)
    assert torch.equal(qa, expected[0]) and torch.equal(ka, expected[1])
    rope.apply_(q, k, pos)  # writes through the strided view into base_q
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])
    untouched = torch.ones_like(base_q, dtype=torch.bool)
    untouched[..., 1:129:2] = False
    assert torch.equal(base_q[untouched], before[untouched])  # nothing outside the view was written


def test_positions_shapes_gqa_and_batch_broadcast():
    rope = Rope(head_dim=64)
    q, k = randn(3, 8, 5, 64), randn(3, 2, 5, 64)
    for pos in (torch.arange(5), torch.arange(5)[None], torch.tensor([[0, 1, 2, 3, 4], [9, 9, 9, 9, 9], [7, 1, 0, 4000, 2]]),
                torch.arange(5, dtype=torch.int32)):
        expected = rope.apply(q, k, pos, impl="reference")
        for got in both(rope, q, k, pos):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_held_table_rows_equal_per_call_tables():
    rope = Rope(head_dim=64, base=1234.5)
    pos = torch.tensor([[3, 70000, 5]])  # beyond the first 4096-row table: it grows
    q, k = randn(1, 2, 3, 64), randn(1, 1, 3, 64)
    expected = rope.apply(q, k, pos, impl="reference")
    got = rope.apply(q, k, pos)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    table = rope.table(70001)
    cos, sin = table.cos, table.sin
    got = rope.apply(q, k, pos, table=table)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    sample = torch.randint(0, 70001, (4, 33), generator=torch.Generator().manual_seed(0))
    c2, s2 = rope.cos_sin(sample)  # [4, 33, 32]: a table row is the same bits wherever it is computed
    assert torch.equal(cos[sample], c2) and torch.equal(sin[sample], s2)


def test_negative_positions_raise_unless_allowed():
    rope = Rope(head_dim=16)
    q, k = randn(1, 2, 3, 16), randn(1, 2, 3, 16)
    pos = torch.tensor([0, -2, 1])
    with pytest.raises(PosencError, match=r"position_ids: expected positions >= 0 .*got min -2"):
        rope.apply_(q, k, pos)
    assert torch.equal(q, randn(1, 2, 3, 16)), "a rejected call wrote into q"
    expected = rope.apply(q, k, pos, allow_negative=True, impl="reference")
    got = rope.apply(q, k, pos, allow_negative=True, impl="cpu")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("scaling", [DynamicNTK(factor=2.0, max_positions=64), YaRN(factor=4.0, original_max_positions=64)])
def test_scalings_exact_phase_mrope_and_seq_len(scaling):
    rope = Rope(head_dim=32, scaling=scaling)
    q, k = randn(2, 3, 9, 32), randn(2, 1, 9, 32)
    pos = torch.arange(9) * 30
    for kw in ({}, {"seq_len": 500}, {"precision": "exact"}):
        expected = rope.apply(q, k, pos, impl="reference", **kw)
        for got in both(rope, q, k, pos, **kw):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), kw
    mrope = Rope(head_dim=32, mrope_section=(4, 6, 6))
    pos3 = torch.randint(0, 50, (3, 2, 9), generator=torch.Generator().manual_seed(3))  # [3, b, t]
    expected = mrope.apply(q, k, pos3, impl="reference")
    for got in both(mrope, q, k, pos3):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_packed_varlen_positions_restart_per_sequence():
    from posenc.rope.packed import packed_positions

    cu = torch.tensor([0, 3, 3, 8])  # three sequences of lengths 3, 0 and 5
    assert packed_positions(cu).tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert packed_positions(cu, offsets=torch.tensor([10, 0, 100])).tolist() == [10, 11, 12, 100, 101, 102, 103, 104]
    rope = Rope(head_dim=16)
    q, k = randn(8, 4, 16), randn(8, 2, 16)
    pos = packed_positions(cu, offsets=torch.tensor([10, 0, 100]))
    (q2, k2), _ = both(rope, q, k, pos, layout="thd")
    for lo, hi, off in ((0, 3, 10), (3, 8, 100)):  # each sequence == its solo run
        solo = rope.apply(q[lo:hi], k[lo:hi], torch.arange(hi - lo) + off, layout="thd", impl="reference")
        assert torch.equal(q2[lo:hi], solo[0]) and torch.equal(k2[lo:hi], solo[1])
    with pytest.raises(PosencError, match="cu_seqlens: expected"):
        packed_positions(torch.tensor([0, 5, 3]))


@pytest.mark.parametrize("pairing", PAIRINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_bit_exact_vs_reference_autograd(pairing, dtype):
    rope = Rope(head_dim=80, rotary_dim=20, pairing=pairing)
    pos = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    grads = []
    for impl in ("reference", "cpu"):
        q = randn(2, 17, 11, 80, dtype=dtype).requires_grad_()
        k = randn(2, 3, 11, 80, dtype=dtype, seed=1).requires_grad_()
        q2, k2 = rope.apply(q, k, pos, impl=impl)
        torch.autograd.backward((q2, k2), (randn(*q2.shape, dtype=dtype, seed=2), randn(*k2.shape, dtype=dtype, seed=3)))
        grads.append((q2.detach(), k2.detach(), q.grad, k.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    if pairing == "interleaved_to_split_half":
        return  # its output pairs differently from its input: applying it twice is no round trip
    # rotating back (the backward's -theta) recovers the input within one rounding
    q = randn(1, 2, 5, 80, dtype=dtype)
    back = rope.apply(*rope.apply(q, q, torch.arange(5)), -torch.arange(5), allow_negative=True)[0]
    assert_close(back, q, dtype=dtype)


def test_rotate_and_attention_use_the_default_fast_path():
    rope = Rope(head_dim=32)
    x = randn(2, 4, 7, 32)
    pos = torch.arange(7) + 100
    assert torch.equal(rope.rotate(x, pos), rope.rotate(x, pos, impl="reference"))
    from posenc.attention import attention

    q, k, v = randn(1, 4, 7, 32), randn(1, 2, 7, 32, seed=1), randn(1, 2, 7, 32, seed=2)
    out = attention(q, k, v, q_positions=pos, k_positions=pos, encoding=rope)
    qr, kr = rope.apply(q, k, pos, impl="reference")
    assert torch.equal(out, attention(qr, kr, v, q_positions=pos, k_positions=pos))


def test_explicit_impl_never_falls_back(monkeypatch, tmp_path):
    rope = Rope(head_dim=16)
    q = randn(1, 2, 3, 16)
    pos = torch.arange(3)
    with pytest.raises(PosencError, match=r"impl: expected None or one of .*got 'fast'"):
        rope.apply(q, q, pos, impl="fast")
    with pytest.raises(PosencError, match=r"impl: expected 'reference' or 'compiled' for compute_dtype"):
        rope.apply(q, q, pos, impl="cpu", compute_dtype=torch.bfloat16)
    if not dispatch.triton_available():
        with pytest.raises(PosencError, match=r"impl: expected 'triton' with the triton package"):
            rope.apply(q, q, pos, impl="triton")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(PosencError, match=r"impl: expected 'triton' with CUDA tensors"):
            rope.apply(q, q, pos, impl="triton")
    # no compiler: the named impl raises, the default quietly uses the reference
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("POSENC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "installed_library", lambda *a, **k: None)  # no install-time build either
    build._loaded.cache_clear(), cpu.entry.cache_clear(), angles.entry.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="the C kernel is unavailable"):  # the default says why, once
            build.library()
        with pytest.raises(PosencError, match=r"impl: expected 'cpu' to be buildable, got reference \(building rope_cpu.c"):
            rope.apply(q, q, pos, impl="cpu")
        expected = rope.apply(q, q, pos, impl="reference")
        assert torch.equal(rope.apply(q, q, pos)[0], expected[0])
    finally:
        build._loaded.cache_clear(), cpu.entry.cache_clear(), angles.entry.cache_clear()


def test_decoder_tables_path_matches_reference():
    from posenc.rope.apply import apply_rope

    rope = Rope(head_dim=48, rotary_dim=32, pairing="interleaved")
    x = randn(2, 3, 6, 48, dtype=torch.bfloat16)
    for pos in (torch.arange(6), torch.randint(0, 90, (2, 6), generator=torch.Generator().manual_seed(0)),
                torch.tensor([5])):
        cos, sin = rope.cos_sin(pos)
        x_in = x if pos.shape[-1] == 6 else x[:, :, :1]
        assert torch.equal(dispatch.rotate(x_in, None, cos, sin, None, "interleaved")[0],
                           apply_rope(x_in, cos, sin, pairing="interleaved"))


def test_bf16_rounding_edge_values_match_reference():
    # denormals, infinities, halfway cases and huge values: the kernel's fast conversion must step aside
    rope = Rope(head_dim=32)
    vals = torch.tensor([1e-39, -1e-39, 3e-38, float("inf"), float("-inf"), 1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0,
                         1e38, 0.0, -0.0])
    q = vals.repeat(24)[: 8 * 32].view(1, 8, 1, 32).to(torch.bfloat16)
    for p in (0, 1, 7, 4095):
        got = rope.apply(q, q, torch.tensor([p]))[0]
        expected = rope.apply(q, q, torch.tensor([p]), impl="reference")[0]
        nan = got.isnan() & expected.isnan()
        assert torch.equal(got.view(torch.int16)[~nan], expected.view(torch.int16)[~nan]), p


@pytest.mark.parametrize("head_dim,rotary_dim", [(4096, 2048), (4096, 4096), (4104, 64), (6000, 2050)])
def test_rows_wider_than_the_kernel_buffers_run_on_the_reference(head_dim, rotary_dim):
    # the C kernel takes rotary_dim <= 2048 and head_dim <= 4096; wider rows: the default impl is the
    # reference (exact as ever), a named "cpu" says why it cannot run
    rope = Rope(head_dim=head_dim, rotary_dim=rotary_dim)
    q, k, pos = randn(1, 2, 3, head_dim, dtype=torch.bfloat16), randn(1, 1, 3, head_dim, seed=1), torch.arange(3) + 5
    k = k.to(torch.bfloat16)
    expected = rope.apply(q, k, pos, impl="reference")
    for got in both(rope, q, k, pos):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    table = rope.table(16)  # a held table: no `held` for rows the kernel cannot hold, and the same results
    assert (table.held is not None) == cpu.fits(rotary_dim, head_dim)
    for got in (rope.apply(q, k, pos, table=table), rope.apply_(q.clone(), k.clone(), pos, table=table)):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    if cpu.fits(rotary_dim, head_dim):
        got = rope.apply(q, k, pos, impl="cpu")
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    else:
        with pytest.raises(PosencError, match=r"^impl: expected 'cpu' with rotary_dim <= 2048 and head_dim <= 4096"):
            rope.apply(q, k, pos, impl="cpu")


def test_kernel_builds_in_the_temp_directory_when_the_cache_folder_cannot_exist(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("POSENC_CACHE_DIR", str(blocker / "cache"))  # a path through a file: mkdir fails
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(build, "installed_library", lambda *a, **k: None)
    build._loaded.cache_clear(), cpu.entry.cache_clear(), angles.entry.cache_clear()
    try:
        rope, q, pos = Rope(head_dim=16), randn(1, 2, 3, 16), torch.arange(3)
        got = rope.apply(q, q, pos, impl="cpu")
        assert torch.equal(got[0], rope.apply(q, q, pos, impl="reference")[0])
        assert list((tmp_path / "tmp").glob("posenc-*/kernels/rope_cpu-*.so"))
    finally:
        build._loaded.cache_clear(), cpu.entry.cache_clear(), angles.entry.cache_clear()


def test_offsets_past_two_to_the_31_elements_in_place_and_allocating():
    # batch index x batch stride passes 2**31 elements (8 GB of untouched virtual memory, its own pages written)
    try:
        q = torch.empty_strided((3, 1, 2, 64), (2**30, 128, 64, 1))
    except (RuntimeError, MemoryError):
        pytest.skip("no 8 GB of virtual memory here")
    rope, pos = Rope(head_dim=64), torch.tensor([5, 9])
    src, k = randn(3, 1, 2, 64), randn(3, 1, 2, 64, seed=1)
    q.copy_(src)
    expected = rope.apply(src, k, pos, impl="reference")
    got = rope.apply(q, k, pos, impl="cpu")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    k_in = k.clone()
    rope.apply_(q, k_in, pos, impl="cpu")
    assert torch.equal(q.contiguous(), expected[0]) and torch.equal(k_in, expected[1])


def test_rope_args_layout_matches_the_c_struct():
    import ctypes

    lib = cpu._lib()
    lib.posenc_args_size.restype = ctypes.c_int64
    assert lib.posenc_args_size() == ctypes.sizeof(cpu.RopeArgs) == cpu._PACK.__self__.size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_threads_split_the_work_and_stay_bit_exact(dtype, threads):
    # large enough for several threads (>= 128 KiB each); GQA (units of q and k differ in size), odd sizes,
    # both memory orders and a batch of positions
    if not cpu.available(dtype):
        pytest.skip(f"no {dtype} kernel here")
    rope = Rope(head_dim=72, rotary_dim=40)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape_q, shape_k, pos in [((2, 12, 301, 72), (2, 3, 301, 72), torch.arange(301) + 11),
                                      ((3, 257, 9, 72), (3, 257, 3, 72), None)]:
            bthd = pos is None
            pos = torch.randint(0, 5000, (3, 257), generator=torch.Generator().manual_seed(1)) if bthd else pos
            q, k = randn(*shape_q, dtype=dtype), randn(*shape_k, dtype=dtype, seed=1)
            layout = "bthd" if bthd else "bhtd"
            expected = rope.apply(q, k, pos, layout=layout, impl="reference")
            got = rope.apply(q, k, pos, layout=layout, impl="cpu")
            qi, ki = q.clone(), k.clone()
            rope.apply_(qi, ki, pos, layout=layout, impl="cpu", table=rope.table(5000))
            for g in (got, (qi, ki)):
                assert torch.equal(g[0], expected[0]) and torch.equal(g[1], expected[1]), (dtype, threads, layout)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not cpu.available(torch.float64), reason="no C compiler for the cpu kernel")
@pytest.mark.parametrize("pairing", ["interleaved", "split_half", "interleaved_to_split_half"])
@pytest.mark.parametrize("rotary_dim", [4, 8, 12])
def test_narrow_float64_rows_are_not_fused(pairing, rotary_dim):
    # a few pairs per row (DeepSeek's 4-pair q_pe, GPT-J's partial rotary): gcc's SLP vectorizer turned the
    # interleaved loop into a fused complex multiply despite -ffp-contract=off (1e-16 off); the build says no
    rope = Rope(head_dim=rotary_dim + 2, rotary_dim=rotary_dim, pairing=pairing)
    g = torch.Generator().manual_seed(rotary_dim)
    q = torch.randn(2, 3, 7, rotary_dim + 2, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1, 7, rotary_dim + 2, generator=g, dtype=torch.float64)
    pos = torch.arange(100, 107)
    got, expected = rope.apply(q, k, pos, impl="cpu"), rope.apply(q, k, pos, impl="reference")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
