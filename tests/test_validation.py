"""One validation layer across the package: every integer position dtype, NumPy scalars, and messages that
name the argument the caller passed."""

import numpy as np
import pytest
import torch

import posenc
from posenc import PosencError, Rope
from posenc.attention import attention
from posenc.bias.alibi import alibi_bias, alibi_slopes
from posenc.bias.relative import T5RelativeBias, t5_relative_position_bucket
from posenc.errors import integer
from posenc.rope.axial import axial_cos_sin
from posenc.rope.mrope import mrope_cos_sin

DTYPES = [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32]
POS = torch.tensor([[0, 3, 7, 11], [2, 5, 6, 9]])
ROPES = [Rope(head_dim=8), Rope(head_dim=8, scaling=posenc.DynamicNTK(2.0, 8)), Rope(head_dim=8, rotary_dim=4,
         pairing="interleaved", scaling=posenc.LongRoPE((1.0, 2.0), (3.0, 4.0), 8))]
torch.manual_seed(0)
T5, LEARNED = T5RelativeBias(4, num_buckets=8, max_distance=10), posenc.LearnedPositions(16, 4)
CALLS = {  # name -> f(positions) for [b, t] positions
    **{f"rope{i}.cos_sin": (lambda p, r=r: torch.cat(r.cos_sin(p), -1)) for i, r in enumerate(ROPES)},
    **{f"rope{i}.apply": (lambda p, r=r: torch.cat(r.apply(torch.ones(2, 2, 4, 8), torch.ones(2, 1, 4, 8), p), 1))
       for i, r in enumerate(ROPES)},
    "rope.rotate[t]": lambda p: ROPES[0].rotate(torch.ones(2, 1, 4, 8), p[0]),
    "alibi_bias": lambda p: alibi_bias(4, p, p[:1]),
    "alibi.score_mod": lambda p: posenc.ALiBi(4).score_mod(p, p)(torch.zeros(()), 1, 2, 3, 0),
    "t5.bias": lambda p: T5.bias(p, p),
    "t5.score_mod": lambda p: T5.score_mod(p, p)(torch.zeros(()), 1, 2, 3, 0),
    "t5_bucket": lambda p: t5_relative_position_bucket(p, num_buckets=8, max_distance=10),
    "sinusoidal": lambda p: posenc.sinusoidal_table(p, 7),
    "sinusoidal_fairseq": lambda p: posenc.sinusoidal_table(p, 8, layout="fairseq"),
    "learned": lambda p: LEARNED(p),
    "mrope": lambda p: torch.cat(mrope_cos_sin(p.expand(3, 2, 4), torch.ones(4), (2, 1, 1)), -1),
    "axial": lambda p: torch.cat(axial_cos_sin(p.T, head_dim=8), -1),
}


@pytest.mark.parametrize("dtype", DTYPES)


@pytest.mark.parametrize("name", sorted(CALLS))


def test_every_integer_dtype_equals_int64(name, dtype):
    want = CALLS[name](POS)
    assert torch.equal(CALLS[name](POS.to(dtype)), want)


def test_numpy_scalars_are_accepted_like_python_ints():
    n = np.int64(8)
    assert Rope(head_dim=n) == Rope(head_dim=8) and type(Rope(head_dim=n).head_dim) is int
    assert Rope(head_dim=8, base=np.float32(500.0)) == Rope(head_dim=8, base=500.0)
    assert torch.equal(alibi_slopes(n), alibi_slopes(8)) and posenc.ALiBi(np.int32(4)).heads == 4
    assert T5RelativeBias(np.int64(2), num_buckets=np.int64(8), max_distance=np.int64(10)).num_buckets == 8
    assert torch.equal(posenc.sinusoidal_table(torch.arange(3), np.int64(6)), posenc.sinusoidal_table(torch.arange(3), 6))
    assert posenc.Sinusoidal(np.int64(6)) == posenc.Sinusoidal(6)
    assert posenc.KVCache(np.int64(1), 1, 1, 4, capacity=np.int32(3)).capacity == 3
    assert posenc.YaRN(np.float64(4.0), np.int64(64)) == posenc.YaRN(4.0, 64)
    for bad in (True, 8.0, "8"):
        with pytest.raises(PosencError, match=r"^num_heads: expected a positive integer, got "):
            alibi_slopes(bad)


@pytest.mark.parametrize("call, message", [
    # positions on another device than q name position_ids (not the cos table built from them)
    (lambda: Rope(head_dim=8).apply(torch.ones(1, 1, 3, 8, device="meta"), torch.ones(1, 1, 3, 8, device="meta"),
                                    torch.arange(3)), r"^position_ids: expected a tensor on meta .*got one on cpu$"),
    (lambda: Rope(head_dim=8).rotate(torch.ones(1, 1, 3, 8, device="meta"), torch.arange(3)),
     r"^position_ids: expected a tensor on meta "),
    # sinusoidal and learned tables take no allow_negative: their message must not suggest one
    (lambda: posenc.sinusoidal_table(torch.tensor([0, -1]), 4), r"^positions: expected positions >= 0, got min -1$"),
    (lambda: posenc.LearnedPositions(4, 2)(torch.tensor([-3])), r"^positions: expected positions >= 0, got min -3$"),
    # Rope tables do take it
    (lambda: Rope(head_dim=8).cos_sin(torch.tensor([-1])),
     r"^position_ids: expected positions >= 0 \(pass allow_negative=True to rotate backwards\), got min -1$"),
    (lambda: alibi_bias(4, [0, 1], torch.arange(2)), r"^q_positions: expected an integer torch\.Tensor, got list$"),
    (lambda: alibi_bias(4, torch.arange(2), [0, 1]), r"^k_positions: expected an integer torch\.Tensor, got list$"),
    (lambda: alibi_bias(4, torch.arange(2), torch.zeros(1, 1, 2, dtype=torch.long)),
     r"^k_positions: expected shape \[t\] or \[b, t\], got tensor of shape \(1, 1, 2\)"),
    (lambda: Rope(head_dim=8).cos_sin(torch.arange(3), precision="fp64"), r"^precision: expected one of \('float32', 'exact'\)"),
    (lambda: Rope(head_dim=8, pairing=1), r"^pairing: expected one of \("),
])


def test_messages_name_the_right_argument(call, message):
    with pytest.raises(PosencError, match=message):
        call()


def test_cos_sin_has_no_ignored_compute_dtype():
    with pytest.raises(TypeError, match="compute_dtype"):
        Rope(head_dim=8).cos_sin(torch.arange(3), compute_dtype=torch.bfloat16)


@pytest.mark.parametrize("pairing", ["split_half", "interleaved"])


def test_rotate_honours_compute_dtype(pairing):
    """`rotate(x, p, compute_dtype=bf16)` rounds tables and products to bf16 (the transformers arithmetic)."""
    rope = Rope(head_dim=8, pairing=pairing)
    x = torch.randn(1, 2, 64, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    pos = torch.arange(1000, 1064)
    cos, sin = (t.bfloat16()[None, None] for t in rope.cos_sin(pos))  # [1, 1, t, r/2] rounded to bf16
    if pairing == "split_half":
        a, b = x[..., :4], x[..., 4:]
        want = torch.cat((a * cos - b * sin, b * cos + a * sin), -1)
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        want = torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)
    got = rope.rotate(x, pos, compute_dtype=torch.bfloat16)
    assert torch.equal(got, want)
    assert not torch.equal(rope.rotate(x, pos), want)  # the float32 default differs: the argument matters


@pytest.mark.parametrize("dtype", DTYPES)


@pytest.mark.parametrize("precision", ["float32", "exact"])


def test_tables_take_every_integer_dtype(dtype, precision):
    from posenc.rope.tables import cos_sin

    inv = torch.tensor([1.0, 0.1, 0.01])
    assert all(torch.equal(a, b) for a, b in zip(cos_sin(POS.to(dtype), inv, 1.0, precision), cos_sin(POS, inv, 1.0, precision)))


@pytest.mark.parametrize("section, message", [
    (4, r"^mrope_section: expected a non-empty list of non-negative integers, got 4$"),
    ((), r"^mrope_section: expected a non-empty list"),
    ((2, "1", 1), r"^mrope_section\[1\]: expected an integer >= 0, got '1'$"),
    ((2, 1, 1.0), r"^mrope_section\[2\]: expected an integer >= 0, got 1\.0$"),
])


def test_mrope_section_checked_before_use(section, message):
    with pytest.raises(PosencError, match=message):
        Rope(head_dim=8, mrope_section=section)
    with pytest.raises(PosencError, match=r"^mrope_interleaved: expected True or False, got 'yes'$"):
        Rope(head_dim=8, mrope_section=(2, 1, 1), mrope_interleaved="yes")
    assert Rope(head_dim=8, mrope_section=[np.int64(2), 1, 1]).mrope_section == (2, 1, 1)


HUGE = 2**70  # a Python int no int64 tensor or torch size can hold

IDS = dict(image_token_id=7, video_token_id=8, vision_start_token_id=9)

TOO_BIG = {  # name -> (call, the argument the message must name)
    "Rope": (lambda: posenc.Rope(head_dim=HUGE), "head_dim"),
    "alibi_slopes": (lambda: posenc.alibi_slopes(HUGE), "num_heads"),
    "LearnedPositions": (lambda: posenc.LearnedPositions(HUGE, 4), "num_positions"),
    "T5RelativeBias": (lambda: posenc.T5RelativeBias(HUGE), "num_heads"),
    "KVCache": (lambda: posenc.KVCache(1, 1, 1, 4, HUGE), "capacity"),
    "attention.window": (lambda: attention(*[torch.ones(1, 1, 2, 4)] * 3, q_positions=torch.arange(2),
                                           k_positions=torch.arange(2), window=HUGE), "window"),
    "mrope_position_ids": (lambda: posenc.mrope_position_ids(torch.ones(1, 3, dtype=torch.long),
                                                             **(IDS | {"image_token_id": HUGE})), "image_token_id"),
}

def _refused(table, name, expected):
    """Call `table[name]`'s function; it must raise a PosencError naming its argument, then `expected`."""
    call, arg = table[name]
    with pytest.raises(PosencError, match=rf"^{arg}: expected {expected}"):
        call()

META = torch.arange(4, device="meta")

NO_VALUES = {  # name -> (call, argument): positions and ids are read, a meta tensor has nothing to read
    "Rope.cos_sin": (lambda: posenc.Rope(head_dim=8).cos_sin(META), "position_ids"),
    "sinusoidal_table": (lambda: posenc.sinusoidal_table(META, 8), "positions"),
    "axial_cos_sin": (lambda: posenc.axial_cos_sin(META.view(2, 2), 8), "positions"),
    "alibi_bias.k": (lambda: posenc.alibi_bias(4, torch.arange(4), META), "k_positions"),
    "mrope_position_ids": (lambda: posenc.mrope_position_ids(META.view(1, 4), **IDS), "input_ids"),
    "vision_patch_positions": (lambda: posenc.vision_patch_positions(torch.ones(1, 3, dtype=torch.long,
                                                                                device="meta")), "grid_thw"),
}

M64 = 2**63 - 1

OVERFLOWING = {  # name -> (call, argument); each wrapped p + 1 or p - q in int64 and returned a wrong result
    "Decoder.position_ids": (lambda: _longrope_decoder()(torch.tensor([[1, 2]]), position_ids=torch.tensor([M64 - 1, M64])),
                             "position_ids"),  # seq_len wrapped negative: short factors at position 2**63 - 1
    "alibi_bias": (lambda: posenc.alibi_bias(4, torch.tensor([M64]), torch.tensor([-M64 - 1])), "q_positions"),
    "t5_bucket": (lambda: posenc.t5_relative_position_bucket(torch.tensor([-M64 - 1, M64])), "relative_position"),
    "rerotate": (lambda: posenc.rerotate(posenc.Rope(head_dim=8, scaling=posenc.DynamicNTK(2.0, 8)),
                                         torch.ones(1, 1, 1, 8), torch.tensor([M64]), torch.tensor([0])), "old_positions"),
    "Rope.cos_sin": (lambda: posenc.Rope(head_dim=8).cos_sin(torch.tensor([2**53 + 1])), "position_ids"),
}

def _longrope_decoder():
    from tests.models.test_decoder import config
    return posenc.models.Decoder.from_hf_config(config("longrope", num_hidden_layers=1), seed=0).double()


@pytest.mark.parametrize("name", TOO_BIG)


def test_integers_beyond_int64_are_refused_by_name(name):
    _refused(TOO_BIG, name, ".*fits in int64")


def test_the_int64_bound_is_inclusive_and_numpy_integers_pass():
    assert integer("n", 2**63 - 1) == 2**63 - 1 and integer("n", -(2**63)) == -(2**63)
    assert integer("n", np.int64(5), min=1) == 5
    with pytest.raises(PosencError, match=r"^n: expected an integer that fits in int64"):
        integer("n", np.uint64(2**64 - 1))


@pytest.mark.parametrize("name", NO_VALUES)


def test_meta_tensors_where_values_are_needed_are_refused_by_name(name):
    _refused(NO_VALUES, name, r"a tensor with values \(not on the meta device\)")


@pytest.mark.parametrize("name", OVERFLOWING)


def test_positions_beyond_2_pow_53_are_refused_by_name(name):
    _refused(OVERFLOWING, name, r"positions with \|p\| <= 2\*\*53")


def test_positions_up_to_2_pow_53_are_still_accepted():
    p = torch.tensor([[2**53 - 1, 2**53]])
    cos, sin = posenc.Rope(head_dim=4).cos_sin(p)  # float32 angles, as checkpoints compute them
    assert bool(((cos.double() ** 2 + sin.double() ** 2 - 1).abs() < 1e-6).all())  # a rotation, whatever the angle
    logits = _longrope_decoder()(torch.tensor([[1, 2]]), position_ids=p)
    assert logits.shape == (1, 2, 50) and bool(torch.isfinite(logits).all())
