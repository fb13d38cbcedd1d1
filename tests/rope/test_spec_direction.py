"""`Rope.direction`: a rotation by -theta (nanochat), against transformers' NanoChat code and the 2x2 oracle.

nanochat's `rotate_half` is `cat(x2, -x1)`, so `q * cos + rotate_half(q) * sin` turns each split-half pair by
-p * inv_freq. posenc states that as `direction=-1`: every table it makes carries the negated angle.
"""

import pytest
import torch
from tests.helpers.tolerances import assert_close
from tests.helpers.oracles import rotate_angles

import posenc
from posenc import PosencError

NANOCHAT = {"model_type": "nanochat", "hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "vocab_size": 32, "intermediate_size": 64, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def test_nanochat_rotation_matches_transformers_bit_for_bit():
    transformers = pytest.importorskip("transformers")
    from transformers.models.nanochat import modeling_nanochat as m

    config = transformers.AutoConfig.for_model("nanochat", **{k: v for k, v in NANOCHAT.items() if k != "model_type"})
    rope = posenc.Rope.from_hf_config(NANOCHAT)
    assert (rope.direction, rope.head_dim, rope.pairing) == (-1, 24, "split_half")
    assert posenc.Rope.from_hf_config(config) == rope
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 37, 24, generator=gen), torch.randn(3, 2, 37, 24, generator=gen)  # odd t
    pos = torch.randint(0, 4000, (3, 37), generator=gen)
    cos, sin = m.NanoChatRotaryEmbedding(config)(q, pos)
    want = m.apply_rotary_pos_emb(q, k, cos, sin)
    for impl in ("reference", None):  # the default picks the fastest implementation for CPU tensors
        got = rope.apply(q, k, pos, impl=impl)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), impl
    table = rope.table(4096)
    assert all(torch.equal(a, b) for a, b in zip(rope.apply(q, k, pos, table=table), want))


@pytest.mark.parametrize("pairing", ["split_half", "interleaved", "interleaved_to_split_half"])
def test_direction_minus_one_turns_each_pair_by_minus_theta(pairing):
    gen = torch.Generator().manual_seed(1)
    rope = posenc.Rope(head_dim=20, rotary_dim=12, base=500.0, pairing=pairing, direction=-1)
    x = torch.randn(2, 3, 9, 20, generator=gen)
    pos = torch.tensor([0, 1, 2, 5, 11, 100, 4095, 9000, 65537])
    # the ladder (checked elsewhere against transformers) as float32 frequencies; the sign is what is tested here
    inv = (1.0 / 500.0 ** (torch.arange(0, 12, 2, dtype=torch.int64).float() / 12)).double()  # [6]
    assert torch.equal(rope.inv_freq()[0].double(), inv)  # inv_freq stays the positive ladder
    want = rotate_angles(x, -pos.double()[:, None] * inv, pairing)  # [2, 3, 9, 20], exact phases
    assert_close(rope.rotate(x, pos, precision="exact").double(), want, torch.float32)
    got = rope.rotate(x, pos)
    assert torch.equal(got[..., 12:], x[..., 12:])  # pass-through channels
    # the same rotation as +theta at the negated positions, bit for bit
    plus = posenc.Rope(head_dim=20, rotary_dim=12, base=500.0, pairing=pairing)
    assert torch.equal(got, plus.rotate(x, -pos, allow_negative=True))


def test_scores_see_the_reversed_offset():
    """q(m) . k(n) under direction -1 equals q(n) . k(m) under +1 for one q/k pair: the offset is n - m."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 1, 16, generator=gen).double(), torch.randn(1, 1, 1, 16, generator=gen).double()
    minus, plus = posenc.Rope(16, direction=-1), posenc.Rope(16)
    for m, n in ((3, 10), (10, 3), (0, 777)):
        a = (minus.rotate(q, torch.tensor([m])) * minus.rotate(k, torch.tensor([n]))).sum()
        b = (plus.rotate(q, torch.tensor([n])) * plus.rotate(k, torch.tensor([m]))).sum()
        assert abs(float(a - b)) < 1e-12


def test_mrope_tables_carry_the_sign():
    rope = posenc.Rope(16, mrope_section=(2, 3, 3), direction=-1)
    pos = torch.tensor([[0, 4, 9], [1, 5, 2], [7, 0, 3]])[:, None]  # [3, 1, t]
    cos, sin = rope.cos_sin(pos)
    cos_p, sin_p = posenc.Rope(16, mrope_section=(2, 3, 3)).cos_sin(pos)
    assert torch.equal(cos, cos_p) and torch.equal(sin, -sin_p)


@pytest.mark.parametrize("bad", [0, 2, True, -1.0, "-1", None])
def test_bad_direction(bad):
    with pytest.raises(PosencError, match="direction: expected 1 or -1"):
        posenc.Rope(16, direction=bad)
