"""ALiBi slopes and bias against transformers' BLOOM and MPT, closed forms, and shift/shard invariants."""

import math

import pytest
import torch
from tests.helpers.tolerances import TOL, assert_close

import posenc
from posenc import ALiBi, PosencError, alibi_bias, alibi_head_slice, alibi_slopes

bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
mpt = pytest.importorskip("transformers.models.mpt.modeling_mpt")


def _paper_slopes(h):
    """Closed form of Press et al. in float64, written independently (geometric + interleaved remainder)."""
    n = 2 ** int(math.log2(h))
    first = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    double = [2.0 ** (-8.0 * i / (2 * n)) for i in range(1, 2 * n + 1)]  # the 2n-head series
    return torch.tensor(first + double[0::2][: h - n], dtype=torch.float64)



def test_slopes_equal_bloom_for_1_to_128_heads():
    for h in range(1, 129):
        ours = alibi_slopes(h)
        # BLOOM's alibi for a one-token mask at position 1 is exactly slope * 1
        ref = bloom.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), h, torch.float32)[:, 0, 1]
        assert ours.shape == (h,) and ours.dtype == torch.float32
        # same arithmetic as BLOOM (float32 base, integer powers): equal bit for bit
        assert torch.equal(ours, ref), f"{h} heads: {(ours - ref).abs().max()}"


@pytest.mark.parametrize("h", [1, 3, 5, 6, 8, 12, 40, 71, 128])
def test_slopes_equal_mpt_and_paper(h):
    ours = alibi_slopes(h)
    # MPT's tensor at key offset -1 (last column - 1) is -slope
    ref = -mpt.build_mpt_alibi_tensor(h, 2)[:, 0, 0]
    assert_close(ours, ref.float(), msg=f"{h} heads vs MPT")
    assert_close(ours.double(), _paper_slopes(h), dtype=torch.float32)
    assert bool((ours > 0).all())


def test_power_of_two_slopes_are_geometric():
    for h in (2, 4, 8, 16, 32, 64):
        s = alibi_slopes(h).double()
        assert_close(s[1:] / s[:-1], torch.full((h - 1,), 2.0 ** (-8.0 / h), dtype=torch.float64), dtype=torch.float32)
        assert float(s[0]) == pytest.approx(2.0 ** (-8.0 / h), rel=1e-7)


def test_head_count_12_listed():
    expected = [2.0**-e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    assert_close(alibi_slopes(12), torch.tensor(expected))


def test_causal_bias_matches_bloom_under_softmax():
    """BLOOM adds slope * k_pos; ours adds -slope * (q_pos - k_pos): equal after a causal softmax."""
    h, t = 6, 11
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(h, t, t, generator=gen)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    ref = bloom.build_alibi_tensor(torch.ones(1, t, dtype=torch.long), h, torch.float32)  # [h, 1, t]
    ours = alibi_bias(h, torch.arange(t), torch.arange(t))  # [h, t, t]
    p_ref = torch.softmax((scores + ref).masked_fill(~causal, float("-inf")), -1)
    p_ours = torch.softmax((scores + ours).masked_fill(~causal, float("-inf")), -1)
    assert_close(p_ours, p_ref)


def test_bias_closed_forms_and_shapes():
    qp, kp = torch.tensor([[5, 7, 8], [0, 1, 2]]), torch.arange(9)
    s = _paper_slopes(5)
    causal = alibi_bias(5, qp, kp)
    sym = alibi_bias(5, qp, kp, symmetric=True)
    assert causal.shape == sym.shape == (2, 5, 3, 9) and causal.dtype == torch.float32
    for b in range(2):
        for h in range(5):
            for i in range(3):
                for j in range(9):
                    d = int(qp[b, i]) - j
                    assert float(causal[b, h, i, j]) == pytest.approx(-s[h].item() * d, rel=1e-6, abs=1e-7)
                    assert float(sym[b, h, i, j]) == pytest.approx(-s[h].item() * abs(d), rel=1e-6, abs=1e-7)
    assert alibi_bias(3, torch.arange(4), torch.arange(6)).shape == (3, 4, 6)


def test_cached_decode_row_equals_full_row_and_shift_invariance():
    full = alibi_bias(12, torch.arange(20), torch.arange(20))
    step = alibi_bias(12, torch.tensor([13]), torch.arange(14))  # query 13 decoded with 13 cached keys
    assert torch.equal(step[:, 0], full[:, 13, :14])
    shifted = alibi_bias(12, torch.arange(20) + 1000, torch.arange(20) + 1000)  # a sequence shard's positions
    assert torch.equal(shifted, full)


def test_tensor_parallel_head_slices_concatenate_to_the_whole():
    qp, kp = torch.arange(4), torch.arange(6)
    whole = alibi_bias(12, qp, kp, symmetric=True)
    parts = [alibi_bias(12, qp, kp, symmetric=True, rank=r, world_size=4) for r in range(4)]
    assert torch.equal(torch.cat(parts, dim=0), whole)
    assert alibi_head_slice(12, 4, 2) == slice(6, 9) == alibi_head_slice(12, rank=2, world_size=4)
    # the group size comes first (as in shard_positions): the older (rank, world_size) order can only be refused
    with pytest.raises(PosencError, match=r"^rank: expected an integer in \[0, world_size=2\), got 4$"):
        alibi_head_slice(12, 2, 4)
    assert torch.equal(ALiBi(12, rank=1, world_size=3).slopes, alibi_slopes(12)[4:8])


def test_score_mod_adds_the_bias():
    scheme = ALiBi(4, symmetric=True)
    qp, kp = torch.tensor([[3, 4], [7, 9]]), torch.tensor([[0, 1, 2], [5, 6, 8]])
    mod = scheme.score_mod(qp, kp)
    dense = scheme.bias(qp, kp)  # [2, 4, 2, 3]
    for b in range(2):
        for h in range(4):
            for i in range(2):
                for j in range(3):
                    out = mod(torch.tensor(0.5), torch.tensor(b), torch.tensor(h), torch.tensor(i), torch.tensor(j))
                    assert float(out) == pytest.approx(0.5 + float(dense[b, h, i, j]), abs=TOL[torch.float32][0])


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: alibi_slopes(0), r"^num_heads: expected .*, got 0$"),
        (lambda: alibi_slopes(-3), r"^num_heads: expected .*, got -3$"),
        (lambda: alibi_slopes(2.0), r"^num_heads: expected .*, got 2.0$"),
        (lambda: alibi_slopes(12, world_size=5), r"^world_size: expected a divisor of num_heads=12, got 5$"),
        (lambda: alibi_slopes(12, rank=4, world_size=4), r"^rank: expected .*, got 4$"),
        (lambda: alibi_bias(0, torch.arange(2), torch.arange(2)), r"^num_heads: expected .*, got 0$"),
        (lambda: alibi_bias(4, torch.arange(2.0), torch.arange(2)), r"^q_positions: expected an integer dtype"),
        (lambda: alibi_bias(4, torch.zeros(1, 1, 2, dtype=torch.long), torch.arange(2)),
         r"^q_positions: expected shape \[t\] or \[b, t\]"),
        (lambda: alibi_bias(4, torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long)),
         r"^k_positions: expected batch size 1 or 2"),
        (lambda: ALiBi(0), r"^num_heads: expected .*, got 0$"),
    ],
)
def test_bad_input_raises(call, pattern):
    with pytest.raises(PosencError, match=pattern):
        call()


def test_zero_heads_message():
    with pytest.raises(PosencError, match=r"num_heads: expected a positive integer, got 0"):
        posenc.alibi_slopes(0)
