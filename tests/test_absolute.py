"""Sinusoidal tables (three layouts) and learned tables against transformers' implementations."""

import math

import pytest
import torch
from tests.helpers.tolerances import assert_close

from posenc import LearnedPositions, PosencError, Sinusoidal, sinusoidal_table

distilbert = pytest.importorskip("transformers.models.distilbert.modeling_distilbert")
marian = pytest.importorskip("transformers.models.marian.modeling_marian")
m2m = pytest.importorskip("transformers.models.m2m_100.modeling_m2m_100")


@pytest.mark.parametrize("dim", [16, 7, 2])
def test_interleaved_equals_distilbert(dim):
    ref = torch.empty(300, dim)
    distilbert.create_sinusoidal_embeddings(300, dim, ref)
    assert_close(sinusoidal_table(torch.arange(300), dim), ref)


@pytest.mark.parametrize("dim", [16, 9])
def test_half_equals_marian(dim):
    emb = marian.MarianSinusoidalPositionalEmbedding(300, dim)
    ref = emb.create_weight()
    assert_close(sinusoidal_table(torch.arange(300), dim, layout="half"), ref)


@pytest.mark.parametrize("dim,padding_idx", [(16, 1), (11, 0), (8, 3)])
def test_fairseq_equals_m2m100(dim, padding_idx):
    emb = m2m.M2M100SinusoidalPositionalEmbedding(300, dim, padding_idx)
    ids = torch.full((2, 9), 5)
    ids[1, :3] = padding_idx  # left padding: M2M100 keeps the pad rows at the padding row
    ref = emb(ids)  # [2, 9, dim]
    ours = sinusoidal_table(torch.arange(9), dim, layout="fairseq", padding_idx=padding_idx)
    assert_close(ours, ref[0])
    assert_close(sinusoidal_table(torch.arange(6), dim, layout="fairseq", padding_idx=padding_idx), ref[1, 3:])
    # cached decoding: position 200 after 200 tokens
    step = emb(torch.full((1, 1), 5), cache_length=200)[0, 0]
    assert_close(sinusoidal_table(torch.tensor(200), dim, layout="fairseq", padding_idx=padding_idx), step)


def test_closed_form_and_batched_shape():
    p = torch.tensor([[0, 3], [100, 4095]])
    out = sinusoidal_table(p, 6, base=500.0, dtype=torch.float64)
    assert out.shape == (2, 2, 6) and out.dtype == torch.float64
    for i in range(2):
        for j in range(2):
            pos = float(p[i, j])
            for c in range(6):
                w = 500.0 ** (-(c // 2 * 2) / 6)
                expected = math.sin(pos * w) if c % 2 == 0 else math.cos(pos * w)
                assert float(out[i, j, c]) == pytest.approx(expected, abs=1e-12)


def _offset_matrix(k, dim, base):
    """M_k for the interleaved layout, from the closed form: a 2x2 rotation by k w_i per (sin, cos) pair."""
    m = torch.zeros(dim, dim, dtype=torch.float64)
    for i in range(dim // 2):
        w = base ** (-2 * i / dim)
        c, s = math.cos(k * w), math.sin(k * w)
        m[2 * i, 2 * i], m[2 * i, 2 * i + 1] = c, s  # sin(a + b) = sin a cos b + cos a sin b
        m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = -s, c  # cos(a + b) = cos a cos b - sin a sin b
    return m


@pytest.mark.parametrize("k", [1, 7, 250])
def test_relative_offset_property(k):
    dim, base = 12, 10000.0
    p = torch.arange(0, 3000, 13)
    pe = sinusoidal_table(p, dim, base, dtype=torch.float64)  # [n, dim]
    shifted = sinusoidal_table(p + k, dim, base, dtype=torch.float64)
    m = _offset_matrix(k, dim, base)
    assert_close(pe @ m.T, shifted)
    # M_k does not depend on p: a least-squares fit on two disjoint position sets gives the same matrix
    base_small = 20.0  # well-conditioned columns for the fit
    fits = []
    for start in (0, 5000):
        q = torch.arange(start, start + 400)
        x = sinusoidal_table(q, 8, base_small, dtype=torch.float64)
        y = sinusoidal_table(q + k, 8, base_small, dtype=torch.float64)
        fits.append(torch.linalg.lstsq(x, y).solution.T)  # y = x M^T
    assert_close(fits[0], fits[1], dtype=torch.float32)
    assert_close(fits[0], _offset_matrix(k, 8, base_small), dtype=torch.float32)


def test_sinusoidal_value_and_errors():
    enc = Sinusoidal(8, layout="fairseq", padding_idx=1)
    assert_close(enc.embedding(torch.arange(4)), sinusoidal_table(torch.arange(4), 8, layout="fairseq"))
    for call, pattern in (
        (lambda: sinusoidal_table(torch.tensor([-1]), 8), r"^positions: expected positions >= 0"),
        (lambda: sinusoidal_table(torch.arange(3.0), 8), r"^positions: expected an integer dtype"),
        (lambda: sinusoidal_table(torch.arange(3), 0), r"^dim: expected .*, got 0$"),
        (lambda: sinusoidal_table(torch.arange(3), 3, layout="fairseq"), r"^dim: expected .*fairseq.*, got 3$"),
        (lambda: sinusoidal_table(torch.arange(3), 8, layout="sin_cos"), r"^layout: expected one of .*'sin_cos'"),
        (lambda: sinusoidal_table(torch.arange(3), 8, base=-1.0), r"^base: expected .*, got -1.0$"),
        (lambda: sinusoidal_table(torch.arange(3), 8, layout="fairseq", padding_idx=-1), r"^padding_idx: expected"),
        (lambda: Sinusoidal(8, layout="nope"), r"^layout: expected one of .*'nope'"),
    ):
        with pytest.raises(PosencError, match=pattern):
            call()


def test_learned_lookup_offset_and_errors():
    table = LearnedPositions(10, 4, offset=2)
    assert table.max_positions == 8
    out = table(torch.tensor([[0, 7], [3, 3]]))
    assert out.shape == (2, 2, 4)
    assert torch.equal(out[0, 0], table.weight[2].detach()) and torch.equal(out[0, 1], table.weight[9].detach())
    with pytest.raises(PosencError, match=r"positions: expected positions < 8 .*got max 8$"):
        table(torch.tensor([8]))
    with pytest.raises(PosencError, match=r"^positions: expected positions >= 0"):
        table(torch.tensor([-1]))
    for call, pattern in ((lambda: LearnedPositions(0, 4), r"^num_positions: expected .*, got 0$"),
                          (lambda: LearnedPositions(4, 4, offset=4), r"^offset: expected .*, got 4$"),
                          (lambda: table.resize(0), r"^max_positions: expected .*, got 0$")):
        with pytest.raises(PosencError, match=pattern):
            call()


def test_resize_linear_matches_loop_reference():
    table = LearnedPositions(7, 3, offset=1)
    new = table.resize(11)
    old = table.weight.detach().double()
    assert new.max_positions == 11 and torch.equal(new.weight[0], table.weight[0])
    n_old, n_new = 6, 11
    for i in range(n_new):  # align_corners=False: sample at (i + 0.5) * n_old / n_new - 0.5, clamped
        x = max((i + 0.5) * n_old / n_new - 0.5, 0.0)
        lo = min(int(math.floor(x)), n_old - 1)
        hi = min(lo + 1, n_old - 1)
        f = x - lo
        expected = (1 - f) * old[1 + lo] + f * old[1 + hi]
        assert_close(new.weight[1 + i].detach().double(), expected, dtype=torch.float32)
    assert table.weight.shape == (7, 3)  # not modified


def test_resize_grid_equals_vit_interpolation():
    vit = pytest.importorskip("transformers.models.vit.modeling_vit")
    cfg = vit.ViTConfig(hidden_size=8, image_size=16, patch_size=4, num_channels=3)  # 4x4 patches + CLS
    emb = vit.ViTEmbeddings(cfg)
    with torch.no_grad():
        emb.position_embeddings.normal_(generator=torch.Generator().manual_seed(0))
    ours = LearnedPositions(17, 8, offset=1)
    with torch.no_grad():
        ours.weight.copy_(emb.position_embeddings[0])
    ref = emb.interpolate_pos_encoding(torch.zeros(1, 1 + 6 * 3, 8), height=24, width=12)[0]  # 6x3 patches
    got = ours.resize_grid((4, 4), (6, 3)).weight.detach()
    assert_close(got, ref.detach())
    with pytest.raises(PosencError, match=r"^grid: expected height \* width = 16 .*, got \(4, 5\)"):
        ours.resize_grid((4, 5), (6, 3))
