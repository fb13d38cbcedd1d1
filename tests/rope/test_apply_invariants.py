"""RoPE invariants against float64 oracles built from explicit 2x2 rotation matrices."""

import dataclasses

import pytest
import torch
from tests.helpers.tolerances import TOL, assert_close
from tests.helpers.oracles import pair_channels, rotate_angles

from posenc import Rope, apply_rope
from posenc.rope.scaling import DynamicNTK, Linear, Llama3, YaRN

PAIRINGS = ["split_half", "interleaved", "interleaved_to_split_half"]
SHAPES = [(2, 4, 16, 64), (3, 5, 37, 72), (1, 1, 1, 2)]  # [b, h, t, d]; odd shapes beside round ones


def ref_inv_freq(theta: float, r: int) -> torch.Tensor:
    """The float32 frequencies as checkpoints define them, written out here: 1 / theta**(2i/r)."""
    return 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))


def oracle(x, positions, inv_freq, pairing="split_half", attention_factor=1.0, angles=None):
    """float64 rotation of `x [b, h, t, d]` by `positions * inv_freq` (or `angles`), through tests/helpers/oracles.py.

    positions: `[t]` or `[b, t]` integers; angles default to `p * inv_freq` in float64.
    """
    if angles is None:
        angles = positions.double()[..., None] * inv_freq.double()  # [b?, t, r/2]
    angles = angles.double()
    if angles.ndim == 3:
        angles = angles[:, None]  # [b, 1, t, r/2]
    return rotate_angles(x, angles, pairing, attention_factor)


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# ------------------------------------------------------------------------------- against the oracle
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pairing", PAIRINGS)
def test_apply_matches_oracle_gqa(shape, pairing):
    b, h, t, d = shape
    rope = Rope(head_dim=d, base=1e4, pairing=pairing)
    q, k = randn(b, h, t, d, seed=1), randn(b, max(h // 2, 1), t, d, seed=2)  # GQA: fewer key heads
    pos = torch.arange(t) * 97 + 11  # logical positions != indices
    q2, k2 = rope.apply(q, k, pos, precision="exact")
    inv = ref_inv_freq(1e4, d)
    assert_close(q2, oracle(q, pos, inv, pairing).float())
    assert_close(k2, oracle(k, pos, inv, pairing).float())


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_default_precision_is_the_checkpoint_formula(pairing):
    # float32 angles = float32(p) * inv_freq, rounded once, as transformers computes them.
    rope = Rope(head_dim=72, pairing=pairing)
    x = randn(2, 3, 9, 72)
    pos = torch.tensor([0, 1, 2, 1000, 4095, 4096, 12345, 65535, 100000])
    inv = ref_inv_freq(1e4, 72)
    angles32 = pos.to(torch.float32)[:, None] * inv  # [t, r/2] float32, the checkpoint convention
    assert_close(rope.rotate(x, pos), oracle(x, pos, inv, pairing, angles=angles32).float())


@pytest.mark.parametrize("rotary", [2, 16, 40])
@pytest.mark.parametrize("pairing", PAIRINGS)
def test_partial_rotary_passes_through_bit_identical(rotary, pairing):
    x = randn(2, 3, 7, 42)
    rope = Rope(head_dim=42, rotary_dim=rotary, pairing=pairing)
    pos = torch.arange(7) + 3
    out = rope.rotate(x, pos, precision="exact")
    assert torch.equal(out[..., rotary:], x[..., rotary:])
    assert_close(out[..., :rotary], oracle(x[..., :rotary], pos, ref_inv_freq(1e4, rotary), pairing).float())


def test_attention_factor_multiplies_cos_and_sin():
    rule = YaRN(4.0, 64)
    rope = Rope(head_dim=16, scaling=rule)
    x, pos = randn(1, 2, 5, 16), torch.arange(5)
    inv, af = rope.inv_freq()
    assert af == pytest.approx(1.13863, abs=5e-6)
    assert_close(rope.rotate(x, pos, precision="exact"), oracle(x, pos, inv, attention_factor=af).float())


# ------------------------------------------------------------------------------- geometric invariants
@pytest.mark.parametrize("pairing", PAIRINGS)
def test_identity_at_position_zero(pairing):
    x = randn(3, 5, 37, 72)
    out = Rope(head_dim=72, pairing=pairing).rotate(x, torch.zeros(37, dtype=torch.int64))
    expected = x if pairing != "interleaved_to_split_half" else torch.cat((x[..., 0::2], x[..., 1::2]), -1)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_norm_preserved_per_pair(pairing):
    x = randn(2, 3, 11, 64, dtype=torch.float64)
    out = Rope(head_dim=64, pairing=pairing).rotate(x, torch.arange(11) * 1000, precision="exact")
    for j in range(32):
        (a, b), (oa, ob) = pair_channels(pairing, 64, j)
        before = x[..., a] ** 2 + x[..., b] ** 2
        after = out[..., oa] ** 2 + out[..., ob] ** 2
        # the tables are float32 by design (rounding <= 3e-8), so the float32 tolerance applies
        assert_close(after, before, dtype=torch.float32)


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_dot_product_depends_only_on_offset(pairing):
    rope = Rope(head_dim=64, pairing=pairing)
    q, k = randn(1, 1, 1, 64, dtype=torch.float64, seed=3), randn(1, 1, 1, 64, dtype=torch.float64, seed=4)
    dots = []
    for start in (0, 7, 1000, 123456):
        qr = rope.rotate(q, torch.tensor([start + 5]), precision="exact")
        kr = rope.rotate(k, torch.tensor([start]), precision="exact")
        dots.append((qr * kr).sum())
    expected = (oracle(q, torch.tensor([5]), ref_inv_freq(1e4, 64), pairing) * oracle(
        k, torch.tensor([0]), ref_inv_freq(1e4, 64), pairing)).sum()
    for dot in dots:
        assert_close(dot, expected, dtype=torch.float32)


def test_composition_r_a_r_b_is_r_a_plus_b():
    rope = Rope(head_dim=48)
    x = randn(2, 2, 6, 48, dtype=torch.float64)
    a, b = torch.tensor([1, 5, 9, 300, 4000, 77]), torch.tensor([2, 0, 11, 1000, 96, 123456])
    twice = rope.rotate(rope.rotate(x, a, precision="exact"), b, precision="exact")
    assert_close(twice, rope.rotate(x, a + b, precision="exact"), dtype=torch.float32)
    back = rope.rotate(rope.rotate(x, a, precision="exact"), -a, precision="exact", allow_negative=True)
    assert_close(back, x, dtype=torch.float32)


def test_interleaved_is_permuted_split_half():
    x = randn(3, 5, 37, 72)
    pos = torch.arange(37) * 13
    perm = torch.cat((torch.arange(0, 72, 2), torch.arange(1, 72, 2)))  # even channels, then odd
    inverse = torch.argsort(perm)
    split = Rope(head_dim=72).rotate(x[..., perm], pos)
    assert torch.equal(Rope(head_dim=72, pairing="interleaved").rotate(x, pos), split[..., inverse])
    assert torch.equal(Rope(head_dim=72, pairing="interleaved_to_split_half").rotate(x, pos), split)
    assert torch.equal(apply_rope(x, *Rope(head_dim=72).cos_sin(pos), interleaved=True), split[..., inverse])


# ------------------------------------------------------------------------------- scaling invariants
def test_linear_at_p_equals_default_at_p_over_factor():
    k = torch.arange(0, 500, 7)
    # factor 4: dividing a float32 frequency by 4 is exact, so the tables are bit-identical
    lin = Rope(head_dim=64, scaling=Linear(4.0)).cos_sin(4 * k)
    dflt = Rope(head_dim=64).cos_sin(k)
    assert torch.equal(lin[0], dflt[0]) and torch.equal(lin[1], dflt[1])
    # factor 2.5 against the float64 closed form cos(p / 2.5 * inv)
    pos = torch.arange(0, 400, 5)
    cos, sin = Rope(head_dim=64, scaling=Linear(2.5)).cos_sin(pos, precision="exact")
    angles = pos.double()[:, None] / 2.5 * ref_inv_freq(1e4, 64).double()
    assert_close(cos, angles.cos().float())
    assert_close(sin, angles.sin().float())


def test_dynamic_up_to_original_length_is_default():
    dyn, dflt = Rope(head_dim=64, scaling=DynamicNTK(4.0, 128)), Rope(head_dim=64)
    for pos in (torch.arange(128), torch.tensor([0, 127]), torch.arange(5)):
        assert torch.equal(dyn.cos_sin(pos)[0], dflt.cos_sin(pos)[0])
    assert not torch.equal(dyn.cos_sin(torch.arange(129))[0][:5], dflt.cos_sin(torch.arange(5))[0])


def test_llama3_high_frequency_band_untouched():
    pos = torch.arange(0, 20000, 333)
    cos, _ = Rope(head_dim=128, base=5e5, scaling=Llama3(8.0, 1.0, 4.0, 8192)).cos_sin(pos)
    cos0, _ = Rope(head_dim=128, base=5e5).cos_sin(pos)
    assert torch.equal(cos[:, :29], cos0[:, :29])  # wavelength < 8192 / 4: channels 0..28
    assert not torch.equal(cos[:, 29:], cos0[:, 29:])


# ------------------------------------------------------------------------------- shapes, layouts, dtypes
def test_layouts_agree():
    rope = Rope(head_dim=40, rotary_dim=24, pairing="interleaved")
    q, k = randn(2, 6, 9, 40, seed=5), randn(2, 3, 9, 40, seed=6)
    pos = torch.arange(9) + 100
    q2, k2 = rope.apply(q, k, pos)
    qt, kt = rope.apply(q.transpose(1, 2), k.transpose(1, 2), pos, layout="bthd")  # non-contiguous inputs too
    assert torch.equal(qt, q2.transpose(1, 2)) and torch.equal(kt, k2.transpose(1, 2))
    qp, kp = rope.apply(q[0].transpose(0, 1), k[0].transpose(0, 1), pos, layout="thd")  # packed [t, h, d]
    assert torch.equal(qp, q2[0].transpose(0, 1)) and torch.equal(kp, k2[0].transpose(0, 1))


def test_batched_positions_and_broadcast():
    rope = Rope(head_dim=32)
    x = randn(3, 2, 5, 32)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [3, 3, 4, 5, 100]])
    out = rope.rotate(x, pos)
    for row in range(3):  # each batch row == its solo run
        assert torch.equal(out[row : row + 1], rope.rotate(x[row : row + 1], pos[row]))
    assert torch.equal(rope.rotate(x, pos[1:2]), rope.rotate(x, pos[1]))  # [1, t] broadcasts like [t]


def test_int32_and_int64_positions_identical():
    rope = Rope(head_dim=64, scaling=DynamicNTK(2.0, 64))
    x, pos = randn(2, 3, 70, 64), torch.arange(70) * 3
    for precision in ("float32", "exact"):
        a = rope.rotate(x, pos, precision=precision)
        assert torch.equal(a, rope.rotate(x, pos.to(torch.int32), precision=precision))


def test_non_contiguous_input_and_no_mutation():
    rope = Rope(head_dim=64, rotary_dim=32)
    base = randn(4, 3, 16, 128)
    x = base[::2, :, :, ::2]  # strided view [2, 3, 16, 64]
    snapshot = base.clone()
    pos = torch.arange(16)
    out = rope.rotate(x, pos)
    assert torch.equal(out, rope.rotate(x.contiguous(), pos))
    assert torch.equal(base, snapshot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_output_dtype_is_input_dtype(dtype):
    rope = Rope(head_dim=72)
    q, k = randn(3, 5, 37, 72, dtype=dtype), randn(3, 1, 37, 72, dtype=torch.float32)
    pos = torch.arange(37) * 31
    q2, k2 = rope.apply(q, k, pos)  # mixed q/k dtypes: each keeps its own
    assert q2.dtype == dtype and k2.dtype == torch.float32
    inv = ref_inv_freq(1e4, 72)
    expected = oracle(q, pos, inv, angles=pos.to(torch.float32)[:, None] * inv)  # checkpoint float32 angles
    # float64 input still meets float32 tables (by design), so it gets the float32 tolerance
    assert_close(q2, expected.to(dtype), dtype=torch.float32 if dtype == torch.float64 else dtype)


@pytest.mark.parametrize("shape,pos", [((2, 3, 0, 8), torch.arange(0)), ((0, 3, 4, 8), torch.arange(4)),
                                       ((0, 3, 4, 8), torch.zeros(0, 4, dtype=torch.int64))])
def test_empty_inputs_give_empty_outputs(shape, pos):
    rope = Rope(head_dim=8, scaling=DynamicNTK(2.0, 4))
    q = torch.empty(shape, dtype=torch.bfloat16)
    q2, k2 = rope.apply(q, q, pos)
    assert q2.shape == shape and q2.dtype == torch.bfloat16 and k2.shape == shape


def test_nan_stays_in_its_row():
    rope = Rope(head_dim=16, pairing="interleaved")
    x = randn(2, 3, 5, 16)
    dirty = x.clone()
    dirty[1, 2, 3, 4] = float("nan")
    pos = torch.arange(5)
    clean, out = rope.rotate(x, pos), rope.rotate(dirty, pos)
    bad = torch.zeros_like(out, dtype=torch.bool)
    bad[1, 2, 3] = True
    assert torch.equal(out[~bad], clean[~bad])
    assert out[1, 2, 3].isnan().any() and not out[~bad].isnan().any()


def test_gradcheck_float64():
    rope = Rope(head_dim=12, rotary_dim=8, pairing="interleaved")
    q = randn(1, 2, 3, 12, dtype=torch.float64).requires_grad_()
    k = randn(1, 1, 3, 12, dtype=torch.float64, seed=7).requires_grad_()
    pos = torch.tensor([3, 1, 4])
    assert torch.autograd.gradcheck(lambda a, b: rope.apply(a, b, pos), (q, k))
    cos, sin = Rope(head_dim=12).cos_sin(pos)
    assert torch.autograd.gradcheck(lambda a: apply_rope(a, cos.double(), sin.double()), (q,))


def test_rope_holds_no_tensors():
    rope = Rope(head_dim=8, scaling=Llama3(8.0, 1.0, 4.0, 8192))
    values = [getattr(rope, f.name) for f in dataclasses.fields(rope)]
    values += [getattr(rope.scaling, f.name) for f in dataclasses.fields(rope.scaling)]
    assert not any(isinstance(v, torch.Tensor) for v in values)
