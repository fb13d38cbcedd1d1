"""`posenc.attention.attention` with chunked masks (Llama 4), a query temperature (Llama 4, Ministral 3),
score soft-capping (Gemma 2) in every impl that can, and attention sinks (gpt-oss, eager).

Oracle: a dense float64 recompute written here from the definitions: one query and one key at a time
(Python loops over positions, no masks shared with the code under test), softmax over the visible keys,
the temperature factor `1 + beta * ln(1 + floor((p + offset) / floor_scale))` in float32 one scalar at a time
(the reference models' arithmetic), floor division of positions by `math.floor`.
"""

import math

import pytest
import torch
from tests.helpers.tolerances import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.attention import attention
from posenc.rope.temperature import QueryTemperature

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")


def dense64(q, k, v, qp, kp, *, scale, causal=True, window=None, chunk=None, temperature=None, softcap=None,
            key_mask=None, sinks=None):
    """Row by row: which keys a query sees, its scores, their softmax; zeros for a query that sees nothing."""
    b, hq, tq, _ = q.shape
    groups = hq // k.shape[1]
    out = torch.zeros(b, hq, tq, v.shape[-1], dtype=torch.float64)
    for r in range(b):
        for i in range(tq):
            p = int(qp[r, i])
            keys = [j for j in range(k.shape[2])
                    if (not causal or int(kp[r, j]) <= p) and (window is None or p - int(kp[r, j]) < window)
                    and (chunk is None or math.floor(p / chunk) == math.floor(int(kp[r, j]) / chunk))
                    and (key_mask is None or bool(key_mask[r, j]))]
            if not keys:
                continue
            factor = 1.0
            if temperature is not None:  # float32 arithmetic, one scalar at a time, as Llama 4 writes it
                step = torch.floor(torch.tensor(p + temperature.offset, dtype=torch.float32) / temperature.floor_scale)
                factor = float(torch.log1p(step) * temperature.beta + 1.0)
            for h in range(hq):
                qi = q[r, h, i].double() * factor
                s = torch.stack([(qi @ k[r, h // groups, j].double()) * scale for j in keys])
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if sinks is not None:  # the sink's logit takes its share of the softmax, which is dropped
                    s = torch.cat((s, sinks[h].double().reshape(1)))
                out[r, h, i] = torch.softmax(s, 0)[:len(keys)] @ v[r, h // groups, keys].double()
    return out


def _inputs(b, hq, hk, tq, tk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, dtype=torch.float64, generator=g) * 2 for h, t in ((hq, tq), (hk, tk), (hk, tk)))
    return q, k, v


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 9, 9, 8), (1, 3, 1, 5, 13, 6)])  # round and odd (MQA, tq != tk)
def test_chunk_and_temperature_equal_dense_recompute(impl, shape):
    b, hq, hk, tq, tk, d = shape
    q, k, v = _inputs(b, hq, hk, tq, tk, d, seed=tq)
    kp = torch.stack([torch.arange(tk) + 3 * r for r in range(b)])  # [b, tk] rows start at different positions
    qp = kp[:, -tq:]  # [b, tq] the last tq keys' positions
    temp = QueryTemperature(beta=0.7, floor_scale=3, offset=1)
    cases = [dict(chunk=4), dict(temperature=temp), dict(chunk=3, temperature=temp, window=5)]
    for kw in cases[-1:] if impl == "flex" else cases:  # flex runs unfused on CPU (seconds per call): one case
        got = attention(q, k, v, q_positions=qp, k_positions=kp, impl=impl, **kw)
        assert_close(got, dense64(q, k, v, qp, kp, scale=d**-0.5, **kw), msg=f"{impl} {kw}")


@pytest.mark.parametrize("impl", ["eager", "flex"])
def test_softcap_equals_dense_recompute(impl):
    q, k, v = _inputs(2, 4, 2, 7, 7, 8, seed=3)
    pos = torch.arange(7)
    mask = torch.tensor([[True] * 7, [False, False] + [True] * 5])  # left padding in row 1
    got = attention(q, k, v, q_positions=pos, k_positions=pos, impl=impl, softcap=1.5, key_mask=mask, scale=0.6)
    want = dense64(q, k, v, pos.expand(2, 7), pos.expand(2, 7), scale=0.6, softcap=1.5, key_mask=mask)
    assert_close(got, want)
    uncapped = attention(q, k, v, q_positions=pos, k_positions=pos, impl=impl, key_mask=mask, scale=0.6)
    assert (uncapped - want).abs().max() > 1e-3  # the cap matters at these scores


def test_sinks_equal_dense_recompute():
    q, k, v = _inputs(2, 4, 2, 6, 9, 8, seed=4)
    kp = torch.arange(9).expand(2, 9)
    qp = kp[:, 3:]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[True] * 9, [False] * 4 + [True] * 5])
    got = attention(q, k, v, q_positions=qp, k_positions=kp, sinks=sinks, key_mask=mask, window=4)
    assert_close(got, dense64(q, k, v, qp, kp, scale=8**-0.5, sinks=sinks, key_mask=mask, window=4))
    plain = attention(q, k, v, q_positions=qp, k_positions=kp, key_mask=mask, window=4)
    assert (plain - got).abs().max() > 1e-2  # the sinks take a visible share


@settings(max_examples=25, deadline=None)
@given(tq=st.integers(1, 6), extra=st.integers(0, 5), start=st.integers(0, 40), chunk=st.integers(1, 7),
       window=st.one_of(st.none(), st.integers(1, 8)), beta=st.floats(0.0, 2.0), floor=st.integers(1, 9),
       offset=st.integers(0, 2), causal=st.booleans())
def test_fuzz_against_dense_recompute(tq, extra, start, chunk, window, beta, floor, offset, causal):
    tk = tq + extra
    q, k, v = _inputs(1, 2, 1, tq, tk, 4, seed=tk)
    kp = torch.arange(start, start + tk)[None]
    qp = kp[:, extra:]
    temp = QueryTemperature(beta=beta, floor_scale=floor, offset=offset)
    kw = dict(chunk=chunk, window=window, temperature=temp, causal=causal)
    assert_close(attention(q, k, v, q_positions=qp, k_positions=kp, **kw), dense64(q, k, v, qp, kp, scale=0.5, **kw))


def test_chunk_is_by_position_not_index():
    """The same keys at positions shifted by a multiple of the chunk give the same output; shifted by 1, not."""
    q, k, v = _inputs(1, 2, 2, 6, 6, 8, seed=5)
    pos = torch.arange(6)
    base = attention(q, k, v, q_positions=pos, k_positions=pos, chunk=4)
    assert_close(attention(q, k, v, q_positions=pos + 8, k_positions=pos + 8, chunk=4), base)
    assert (attention(q, k, v, q_positions=pos + 1, k_positions=pos + 1, chunk=4) - base).abs().max() > 1e-3


@pytest.mark.parametrize("kw, match", [
    (dict(chunk=0), r"^chunk: expected None or an integer >= 1"),
    (dict(chunk=2.5), r"^chunk: expected None or an integer >= 1"),
    (dict(temperature=0.1), r"^temperature: expected None or a posenc.rope.temperature.QueryTemperature"),
    (dict(softcap=0.0), r"^softcap: expected None or a finite number > 0"),
    (dict(softcap=float("nan")), r"^softcap: expected None or a finite number > 0"),
    (dict(softcap=2.0, impl="sdpa"), r"^impl: expected 'eager' or 'flex' with a softcap"),
    (dict(temperature=QueryTemperature(0.1, 4), q_positions=torch.tensor([-1, 0, 1])), r"^q_positions: expected positions >= 0"),
    (dict(sinks=torch.zeros(3)), r"^sinks: expected a tensor of shape \[hq=2\]"),
    (dict(sinks=torch.zeros(2, dtype=torch.long)), r"^sinks: expected a floating-point dtype"),
    (dict(sinks=torch.zeros(2), impl="sdpa"), r"^impl: expected 'eager' with sinks"),
    (dict(sinks=torch.zeros(2), impl="flex"), r"^impl: expected 'eager' with sinks"),
])
def test_bad_score_options_refused(kw, match):
    q, k, v = _inputs(1, 2, 2, 3, 3, 4, seed=0)
    args = dict(q_positions=torch.arange(3), k_positions=torch.arange(3)) | kw
    q0 = q.clone()
    with pytest.raises(posenc.PosencError, match=match):
        attention(q, k, v, **args)
    assert torch.equal(q, q0)
