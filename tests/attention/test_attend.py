"""Reference attention with any encoding: eager vs an independent loop, and the flex / sdpa paths vs eager."""

import math

import pytest
import torch
from tests.helpers.tolerances import TOL, assert_close

from posenc import ALiBi, LearnedPositions, PosencError, Rope, Sinusoidal, T5RelativeBias
from posenc.attention import attention

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")


def _loop_reference(q, k, v, qp, kp, bias, causal, key_mask, scale, window=None):
    """Per (b, h, i) softmax in float64 with Python loops; bias is a callable (b, h, i, j) -> float."""
    b, hq, tq, _ = q.shape
    hk, tk = k.shape[1], k.shape[2]
    out = torch.zeros(b, hq, tq, v.shape[-1], dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(tq):
                keys = [j for j in range(tk) if (not causal or kp[bi, j] <= qp[bi, i]) and key_mask[bi, j]
                        and (window is None or qp[bi, i] - kp[bi, j] < window)]
                if not keys:
                    continue
                s = torch.tensor([float(q[bi, h, i] @ k[bi, kh, j]) * scale + bias(bi, h, i, j) for j in keys])
                p = torch.softmax(s, 0)
                out[bi, h, i] = sum(p[n] * v[bi, kh, j] for n, j in enumerate(keys))
    return out


def _case(gen, b=2, hq=6, hk=2, tq=5, tk=13, d=8, dv=3, offset=8):
    q = torch.randn(b, hq, tq, d, generator=gen)
    k = torch.randn(b, hk, tk, d, generator=gen)
    v = torch.randn(b, hk, tk, dv, generator=gen)
    qp = torch.arange(offset, offset + tq).expand(b, tq).clone()  # queries decoded after `offset` cached tokens
    kp = torch.arange(tk).expand(b, tk).clone()
    mask = torch.ones(b, tk, dtype=torch.bool)
    if b > 1:  # row 1 is left-padded by 2: its logical positions start 2 lower
        qp[1] -= 2
        kp[1] = (kp[1] - 2).clamp(min=0)
        mask[1, :2] = False
    return q, k, v, qp, kp, mask


SCHEMES = {
    "alibi": lambda: ALiBi(6),
    "alibi_symmetric": lambda: ALiBi(6, symmetric=True),
    "t5_causal": lambda: T5RelativeBias(6, num_buckets=8, max_distance=10, bidirectional=False),
    "t5_bidirectional": lambda: T5RelativeBias(6, num_buckets=8, max_distance=10),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("causal", [True, False])
def test_eager_bias_equals_loop_reference(gen, scheme, causal):
    enc = SCHEMES[scheme]()
    q, k, v, qp, kp, mask = _case(gen)
    dense = enc.bias(qp, kp).detach()  # [b, h, tq, tk]
    if isinstance(enc, ALiBi):  # closed form, independent of the bias code
        slopes = [2.0 ** (-8 * (i + 1) / 4) for i in range(4)] + [2.0 ** (-4 * (2 * j - 1) / 4) for j in (1, 2)]
        def bias(bi, h, i, j):
            dist = int(qp[bi, i] - kp[bi, j])
            return -slopes[h] * (abs(dist) if enc.symmetric else dist)
    else:
        def bias(bi, h, i, j):
            return float(dense[bi, h, i, j])
    ref = _loop_reference(q, k, v, qp, kp, bias, causal, mask, 1 / math.sqrt(8))
    out = attention(q, k, v, q_positions=qp, k_positions=kp, encoding=enc, causal=causal, key_mask=mask)
    assert out.shape == (2, 6, 5, 3) and out.dtype == torch.float32
    assert_close(out.double(), ref, dtype=torch.float32)


@pytest.mark.parametrize("impl", ["flex", "sdpa"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [dict(), dict(b=1, hq=4, hk=4, tq=1, tk=37, d=16, dv=16, offset=36)])
def test_flex_and_sdpa_equal_eager(gen, impl, scheme, causal, shape):
    enc = SCHEMES[scheme]()
    if "hq" in shape:
        enc = ALiBi(4, symmetric=enc.symmetric) if isinstance(enc, ALiBi) else T5RelativeBias(
            4, num_buckets=8, max_distance=10, bidirectional=enc.bidirectional)
    q, k, v, qp, kp, mask = _case(gen, **shape)
    kw = dict(q_positions=qp, k_positions=kp, encoding=enc, causal=causal, key_mask=mask)
    with torch.no_grad():
        eager = attention(q, k, v, **kw)
        other = attention(q, k, v, impl=impl, **kw)
    torch.testing.assert_close(other, eager, atol=1e-5, rtol=0)  # the bar: fp32, 1e-5 absolute


def test_bias_changes_the_output_in_every_impl(gen):
    q, k, v, qp, kp, mask = _case(gen)
    for impl in ("eager", "sdpa", "flex"):
        plain = attention(q, k, v, q_positions=qp, k_positions=kp, impl=impl)
        biased = attention(q, k, v, q_positions=qp, k_positions=kp, encoding=ALiBi(6), impl=impl)
        assert float((plain - biased).abs().max()) > 1e-3, impl


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("scheme", ["alibi", "t5_causal", "rope", "sinusoidal"])
def test_cached_decode_equals_full_sequence(gen, impl, scheme):
    """Each query run alone against the keys so far (as with a KV cache) equals its row of the full run."""
    enc = {"rope": Rope(head_dim=8), "sinusoidal": Sinusoidal(8)}.get(scheme) or SCHEMES[scheme]()
    t = 9
    q, k, v = (torch.randn(1, 6, t, 8, generator=gen), torch.randn(1, 3, t, 8, generator=gen),
               torch.randn(1, 3, t, 8, generator=gen))
    pos = torch.arange(100, 100 + t)  # a sequence that starts at logical position 100
    with torch.no_grad():
        full = attention(q, k, v, q_positions=pos, k_positions=pos, encoding=enc, impl=impl)
        for i in range(t):
            step = attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], q_positions=pos[i : i + 1],
                             k_positions=pos[: i + 1], encoding=enc, impl=impl)
            assert_close(step[:, :, 0], full[:, :, i])


def test_rope_encoding_equals_pre_rotated(gen):
    rope = Rope(head_dim=8, base=500.0)
    q, k, v, qp, kp, mask = _case(gen)
    out = attention(q, k, v, q_positions=qp, k_positions=kp, encoding=rope, key_mask=mask)
    q2, k2 = rope.rotate(q, qp), rope.rotate(k, kp)
    assert_close(out, attention(q2, k2, v, q_positions=qp, k_positions=kp, key_mask=mask))


def test_absolute_encoding_adds_embeddings(gen):
    table = LearnedPositions(32, 8)
    q, k, v, qp, kp, mask = _case(gen)
    with torch.no_grad():
        out = attention(q, k, v, q_positions=qp, k_positions=kp, encoding=table, key_mask=mask, impl="flex")
        q2 = q + table(qp)[:, None]  # [b, 1, tq, d]
        k2 = k + table(kp)[:, None]
        assert_close(out, attention(q2, k2, v, q_positions=qp, k_positions=kp, key_mask=mask))


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex"])
def test_rows_with_no_visible_key_are_zero(gen, impl):
    q, k, v = torch.randn(2, 2, 3, 4, generator=gen), torch.randn(2, 2, 4, 4, generator=gen), torch.randn(2, 2, 4, 4)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1] = False  # batch row 1: empty cache
    qp = torch.tensor([0, 5, 6])
    kp = torch.tensor([3, 4, 5, 6])  # query at 0 sees no key under the causal mask
    with torch.no_grad():
        out = attention(q, k, v, q_positions=qp, k_positions=kp, key_mask=mask, encoding=ALiBi(2), impl=impl)
    assert not out.isnan().any()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))
    assert float(out[0, :, 1:].abs().sum()) > 0


def test_no_nan_gradient_with_empty_rows(gen):
    q = torch.randn(1, 1, 2, 4, generator=gen, requires_grad=True)
    k = torch.randn(1, 1, 2, 4, generator=gen, requires_grad=True)
    out = attention(q, k, torch.randn(1, 1, 2, 4, generator=gen), q_positions=torch.tensor([0, 5]), k_positions=torch.tensor([3, 4]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_bf16_returns_bf16_close_to_fp32(gen):
    q, k, v, qp, kp, mask = _case(gen)
    ref = attention(q, k, v, q_positions=qp, k_positions=kp, encoding=ALiBi(6), key_mask=mask)
    out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_positions=qp, k_positions=kp, encoding=ALiBi(6),
                    key_mask=mask)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref.bfloat16(), dtype=torch.bfloat16)


def test_t5_scale_one(gen):
    enc = SCHEMES["t5_bidirectional"]()
    q, k, v, qp, kp, mask = _case(gen)
    with torch.no_grad():
        out = attention(q, k, v, q_positions=qp, k_positions=kp, encoding=enc, causal=False, scale=1.0, impl="flex")
        dense = enc.bias(qp, kp)
    ref = _loop_reference(q, k, v, qp, kp, lambda b, h, i, j: float(dense[b, h, i, j]), False,
                          torch.ones(2, 13, dtype=torch.bool), 1.0)
    assert_close(out.double(), ref, dtype=torch.float32)


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(k=torch.ones(1, 3, 5, 8), v=torch.ones(1, 3, 5, 8)), "k"),  # 4 query heads, 3 key heads
        (dict(v=torch.ones(1, 2, 4, 8)), "v"),
        (dict(q_positions=torch.arange(3.0)), "q_positions"),
        (dict(k_positions=torch.arange(4)), "k_positions"),
        (dict(key_mask=torch.ones(1, 5)), "key_mask"),
        (dict(impl="triton"), "impl"),
        (dict(encoding="rope"), "encoding"),
        (dict(encoding=ALiBi(8)), "encoding"),
        (dict(encoding=Sinusoidal(6)), "encoding"),
        (dict(encoding=LearnedPositions(3, 8)), "positions"),  # position 4 past a 3-row table
        (dict(scale=float("nan")), "scale"),
    ],
)
def test_bad_input_raises(kwargs, arg):
    args = dict(q=torch.ones(1, 4, 3, 8), k=torch.ones(1, 2, 5, 8), v=torch.ones(1, 2, 5, 8),  # shapes are what matter
                q_positions=torch.arange(2, 5), k_positions=torch.arange(5))
    args.update(kwargs)
    with pytest.raises(PosencError, match=f"^{arg}: expected"):
        attention(**args)


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("window", [1, 3, 7, 100])
def test_sliding_window_equals_loop_reference(gen, impl, window):
    """A query at p sees keys at p - window + 1 .. p (logical positions), also with a bias and left padding."""
    enc = ALiBi(6)
    q, k, v, qp, kp, mask = _case(gen)
    dense = enc.bias(qp, kp)  # [b, h, tq, tk]
    ref = _loop_reference(q, k, v, qp, kp, lambda bi, h, i, j: float(dense[bi, h, i, j]), True, mask,
                          1 / math.sqrt(8), window=window)
    out = attention(q, k, v, q_positions=qp, k_positions=kp, encoding=enc, key_mask=mask, window=window, impl=impl)
    assert_close(out.double(), ref, dtype=torch.float32)
    if window < 7:  # a window shorter than the visible history changes the result
        full = attention(q, k, v, q_positions=qp, k_positions=kp, encoding=enc, key_mask=mask, impl=impl)
        assert not torch.allclose(out, full)


@pytest.mark.parametrize("window", [0, -2, 2.5, True])
def test_bad_window(gen, window):
    q, k, v, qp, kp, mask = _case(gen)
    with pytest.raises(PosencError, match="window: expected None or an integer >= 1"):
        attention(q, k, v, q_positions=qp, k_positions=kp, window=window)
