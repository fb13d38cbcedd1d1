"""T5 relative buckets and the learned bias against transformers' T5Attention."""

import pytest
import torch
from tests.helpers.tolerances import assert_close

from posenc import PosencError, T5RelativeBias, t5_relative_position_bucket

t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
T5Attention = t5.T5Attention


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (6, 7)])
def test_buckets_equal_transformers(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-2000, 2001)
    ours = t5_relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    ref = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    mismatches = int((ours != ref).sum())
    print(f"T5 buckets nb={num_buckets} md={max_distance} bidirectional={bidirectional}: {mismatches} mismatches")
    assert torch.equal(ours, ref)
    assert int(ours.min()) >= 0 and int(ours.max()) < num_buckets


def test_known_values_written_out():
    rel = torch.tensor([-128, -20, -1, 0, 1, 20, 128, 5000])
    assert t5_relative_position_bucket(rel).tolist() == [15, 10, 1, 0, 17, 26, 31, 31]
    assert t5_relative_position_bucket(rel, bidirectional=False).tolist() == [31, 17, 1, 0, 0, 0, 0, 0]


def test_bucket_loop_reference():
    """An independent per-element loop in float64 math (T5 paper rule) for small tables."""
    import math

    def ref(r, bidirectional, nb, md):
        out = 0
        if bidirectional:
            nb //= 2
            out += nb if r > 0 else 0
            n = abs(r)
        else:
            n = max(-r, 0)
        exact = nb // 2
        if n < exact:
            return out + n
        return out + min(nb - 1, exact + int(math.log(n / exact) / math.log(md / exact) * (nb - exact)))

    rel = torch.arange(-300, 301)
    for bi, nb, md in [(True, 32, 128), (False, 32, 128), (True, 10, 50), (False, 7, 40)]:
        ours = t5_relative_position_bucket(rel, bi, nb, md).tolist()
        assert ours == [ref(int(r), bi, nb, md) for r in rel], (bi, nb, md)


def _hf_attention(is_decoder, heads=3, nb=32, md=128):
    cfg = t5.T5Config(d_model=16, d_kv=4, num_heads=heads, relative_attention_num_buckets=nb,
                      relative_attention_max_distance=md, is_decoder=is_decoder)
    with torch.random.fork_rng(devices=[]):  # seeded weights, the global generator left as it was
        torch.manual_seed(0)
        return T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_bias_equals_t5_compute_bias(is_decoder):
    hf = _hf_attention(is_decoder)
    ours = T5RelativeBias(3, bidirectional=not is_decoder)
    with torch.no_grad():
        ours.weight.copy_(hf.relative_attention_bias.weight)
    ref = hf.compute_bias(37, 37)[0]  # [h, q, k]
    assert_close(ours.bias(torch.arange(37), torch.arange(37)), ref)
    # cached decoding: 5 new queries after 150 cached tokens
    ref_cached = hf.compute_bias(5, 155, past_seen_tokens=150)[0]
    got = ours.bias(torch.arange(150, 155), torch.arange(155))
    assert_close(got, ref_cached)
    full = ours.bias(torch.arange(155), torch.arange(155))
    assert torch.equal(got, full[:, 150:])  # the cached rows are the full-sequence rows


def test_batched_positions_and_shape():
    ours = T5RelativeBias(2, num_buckets=8, max_distance=16, bidirectional=False)
    qp = torch.tensor([[3, 4], [10, 11]])
    kp = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    out = ours.bias(qp, kp)
    assert out.shape == (2, 2, 2, 5) and out.dtype == torch.float32
    # both rows hold the same relative offsets, so the same bias
    assert torch.equal(out[0], out[1])


def test_bias_stays_float32_after_bf16_cast():
    ours = T5RelativeBias(2).to(torch.bfloat16)
    assert ours.bias(torch.arange(3), torch.arange(3)).dtype == torch.float32


def test_score_mod_matches_dense_bias():
    ours = T5RelativeBias(3, num_buckets=16, max_distance=40, bidirectional=True)
    qp, kp = torch.tensor([0, 25, 60]), torch.tensor([1, 3, 50, 70])
    with torch.no_grad():
        mod, dense = ours.score_mod(qp, kp), ours.bias(qp, kp)
    for h in range(3):
        for i in range(3):
            for j in range(4):
                with torch.no_grad():
                    out = mod(torch.tensor(1.0), torch.tensor(0), torch.tensor(h), torch.tensor(i), torch.tensor(j))
                assert float(out) == pytest.approx(1.0 + float(dense[h, i, j]), abs=1e-6)


def test_gradient_reaches_the_table():
    ours = T5RelativeBias(2, num_buckets=8, max_distance=16)
    ours.bias(torch.arange(4), torch.arange(4)).sum().backward()
    assert ours.weight.grad is not None and float(ours.weight.grad.abs().sum()) > 0


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda: t5_relative_position_bucket(torch.arange(3), True, 32, 8), "max_distance"),  # max_exact 8
        (lambda: t5_relative_position_bucket(torch.arange(3), False, 32, 16), "max_distance"),  # max_exact 16
        (lambda: t5_relative_position_bucket(torch.arange(3), True, 7, 100), "num_buckets"),
        (lambda: t5_relative_position_bucket(torch.arange(3), True, 2, 100), "num_buckets"),
        (lambda: t5_relative_position_bucket(torch.arange(3), False, 1, 100), "num_buckets"),
        (lambda: t5_relative_position_bucket(torch.arange(3.0)), "relative_position"),
        (lambda: T5RelativeBias(0), "num_heads"),
        (lambda: T5RelativeBias(4, num_buckets=32, max_distance=4), "max_distance"),
    ],
)
def test_bad_input_raises(call, arg):
    with pytest.raises(PosencError, match=f"^{arg}: expected"):
        call()


def test_max_distance_boundary_is_mode_dependent():
    # 16 is above the bidirectional exact range (8) but not the causal one (16)
    t5_relative_position_bucket(torch.arange(3), True, 32, 16)
    with pytest.raises(PosencError, match=r"^max_distance: expected .*causal.*, got 16$"):
        t5_relative_position_bucket(torch.arange(3), False, 32, 16)
