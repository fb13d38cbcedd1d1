"""posenc.attention with length-dependent RoPE scalings (one table for q and k), empty inputs, and bad positions."""

import pytest
import torch
from tests.helpers.tolerances import assert_close

import posenc
from posenc import ALiBi, LearnedPositions, PosencError, Rope, Sinusoidal, T5RelativeBias
from posenc.attention import attention

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

L0 = 8  # original context of the scaled Ropes below: a 10-token forward crosses it
SCALED = {
    "longrope": Rope(head_dim=8, scaling=posenc.LongRoPE((1.0, 1.5, 2.0, 3.0), (1.0, 4.0, 9.0, 20.0), L0, 1.19)),
    "dynamic": Rope(head_dim=8, scaling=posenc.DynamicNTK(factor=4.0, max_positions=L0)),
    "longrope_partial": Rope(head_dim=10, rotary_dim=6, pairing="interleaved",
                             scaling=posenc.LongRoPE((1.0, 2.0, 3.0), (1.5, 6.0, 30.0), L0)),
}


def _rotate64(rope, x, positions, seq_len):
    """float64 oracle: each pair as a complex number times exp(i p w), w the rule's frequencies at `seq_len`."""
    inv, factor = rope.inv_freq(seq_len)
    half = rope.rotary_dim // 2
    x = x.double()
    rot, rest = x[..., : rope.rotary_dim], x[..., rope.rotary_dim:]
    if rope.pairing == "split_half":
        z = torch.complex(rot[..., :half], rot[..., half:])
    else:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2])
    z = z * torch.polar(torch.full_like(inv.double(), factor), positions.double()[:, None] * inv.double())  # [..., t, r/2]
    pairs = (z.real, z.imag)
    out = torch.cat(pairs, -1) if rope.pairing == "split_half" else torch.stack(pairs, -1).flatten(-2)
    return torch.cat((out, rest), -1)


def _softmax_attention64(q, k, v, qp, kp, causal):
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # [b, h, tq, tk]
    if causal:
        scores = scores.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v.double()


@pytest.mark.parametrize("name", sorted(SCALED))
@pytest.mark.parametrize("causal", [False, True])
def test_one_table_at_the_forwards_length(name, causal, gen):
    """Queries 0..4 against keys 0..9: q and k both use the table of length 10, as a full forward does."""
    rope = SCALED[name]
    d = rope.head_dim
    q = torch.randn(1, 2, 10, d, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 10, d, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, 10, 3, generator=gen, dtype=torch.float64)
    pos = torch.arange(10)
    want = _softmax_attention64(_rotate64(rope, q, pos, 10), _rotate64(rope, k, pos, 10), v, pos, pos, causal)
    full = attention(q, k, v, q_positions=pos, k_positions=pos, encoding=rope, causal=causal)
    assert_close(full, want, dtype=torch.float32)  # the tables are float32 (checkpoint arithmetic)
    chunk = attention(q[:, :, :5], k, v, q_positions=pos[:5], k_positions=pos, encoding=rope, causal=causal)
    assert_close(chunk, want[:, :, :5], dtype=torch.float32)  # a chunk of queries equals those rows of the full forward
    late = attention(q[:, :, 5:], k[:, :, :5], v[:, :, :5], q_positions=pos[5:], k_positions=pos[:5], encoding=rope,
                     causal=causal)  # queries after every key: the keys too use the table of length 10
    want_late = _softmax_attention64(_rotate64(rope, q[:, :, 5:], pos[5:], 10), _rotate64(rope, k[:, :, :5], pos[:5], 10),
                                     v[:, :, :5], pos[5:], pos[:5], causal)
    assert_close(late, want_late, dtype=torch.float32)
    if not causal:  # the short table would give another answer: the test can see the bug
        short = _softmax_attention64(_rotate64(rope, q[:, :, :5], pos[:5], 5), _rotate64(rope, k, pos, 10), v,
                                     pos[:5], pos, causal)
        assert not torch.allclose(chunk, short, atol=1e-3)


@pytest.mark.parametrize("name", ["longrope", "dynamic"])
@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex"])
def test_scores_depend_on_relative_position_only(name, impl):
    """Keys 5..9 after queries 0..4, same content everywhere: log p[i, j] - log p[i, j+1] depends on j - i only."""
    rope = SCALED[name]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64).expand(1, 1, 5, 8)
    k = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64).expand(1, 1, 5, 8)
    v = torch.eye(5, dtype=torch.float64)[None, None]  # [1, 1, tk=5, dv=5]: the output is the probabilities
    probs = attention(q, k, v, q_positions=torch.arange(5), k_positions=torch.arange(5, 10), encoding=rope,
                      causal=False, impl=impl)[0, 0]  # [tq, tk]
    step = probs.log()[:, :-1] - probs.log()[:, 1:]  # [i, j] = s(j - i) - s(j + 1 - i)
    assert_close(step[1:, 1:], step[:-1, :-1], dtype=torch.float32)


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("encoding", [None, Rope(head_dim=8), ALiBi(4), Sinusoidal(8)], ids=["none", "rope", "alibi", "sin"])
@pytest.mark.parametrize("b, tq, tk", [(0, 3, 5), (2, 0, 5), (2, 3, 0), (0, 0, 0)])
def test_empty_inputs_give_empty_or_zero_outputs(impl, encoding, b, tq, tk):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(b, 4, tq, 8, generator=g), torch.randn(b, 2, tk, 8, generator=g), torch.randn(b, 2, tk, 3, generator=g)
    out = attention(q, k, v, q_positions=torch.arange(tq), k_positions=torch.arange(tk), encoding=encoding, impl=impl)
    assert out.shape == (b, 4, tq, 3) and out.dtype == q.dtype and not out.any()  # no key: zeros, never NaN


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int16, torch.int32])
@pytest.mark.parametrize("encoding", [Rope(head_dim=8), SCALED["dynamic"], ALiBi(4), T5RelativeBias(4),
                                      Sinusoidal(8), LearnedPositions(16, 8)],
                         ids=["rope", "dynamic", "alibi", "t5", "sin", "learned"])
def test_every_integer_position_dtype_equals_int64(dtype, encoding, gen):
    q, k, v = torch.randn(2, 4, 3, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 3)
    qp, kp = torch.tensor([[2, 3, 4], [9, 10, 11]]), torch.tensor([0, 1, 2, 3, 4])
    want = attention(q, k, v, q_positions=qp, k_positions=kp, encoding=encoding)
    got = attention(q, k, v, q_positions=qp.to(dtype), k_positions=kp.to(dtype), encoding=encoding)
    assert torch.equal(got, want)


def _args(**kw):
    g = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(2, 4, 3, 8, generator=g), k=torch.randn(2, 2, 5, 8, generator=g),
                v=torch.randn(2, 2, 5, 8, generator=g),
                q_positions=torch.arange(2, 5), k_positions=torch.arange(5), encoding=Rope(head_dim=8))
    return args | kw


@pytest.mark.parametrize("kw, message", [
    (dict(k_positions=torch.tensor([-1, 0, 1, 2, 3])), r"^k_positions: expected positions >= 0 .*got min -1$"),
    (dict(q_positions=torch.tensor([[-2, 0, 1]])), r"^q_positions: expected positions >= 0 .*got min -2$"),
    (dict(encoding=Rope(head_dim=6)), r"^encoding: expected a Rope with head_dim=8 .*got Rope\(head_dim=6"),
    (dict(encoding=Rope(head_dim=16)), r"^encoding: expected a Rope with head_dim=8 "),
    (dict(q_positions=torch.arange(3).expand(3, 3)), r"^q_positions: expected batch size 1 or 2, got tensor of shape \(3, 3\)"),
    (dict(k_positions=torch.arange(5).expand(3, 5)), r"^k_positions: expected batch size 1 or 2, got tensor of shape \(3, 5\)"),
    (dict(q_positions=torch.arange(4)), r"^q_positions: expected shape \[3\] or \[b, 3\], got tensor of shape \(4,\)"),
    (dict(q_positions=torch.arange(3, device="meta")), r"^q_positions: expected a tensor on cpu .*got one on meta$"),
    (dict(k_positions=[0, 1, 2, 3, 4]), r"^k_positions: expected an integer torch\.Tensor, got list$"),
])
def test_messages_name_the_argument(kw, message):
    with pytest.raises(PosencError, match=message):
        attention(**_args(**kw))
