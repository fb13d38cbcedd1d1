"""Property-based test: random shapes, dtypes, pairings, rotary widths, layouts and positions vs a float64 oracle."""

import pytest
import torch
from tests.helpers.tolerances import assert_close
from tests.rope.test_apply_invariants import PAIRINGS, oracle, ref_inv_freq

from posenc import Rope

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(["bhtd", "bthd", "thd"]))
    b = 1 if layout == "thd" else draw(st.integers(0, 3))
    t = draw(st.integers(0, 9))
    half = draw(st.integers(1, 24))
    head_dim = 2 * half + draw(st.sampled_from([0, 0, 1, 2]))  # odd head dims with an even rotary width
    rotary = 2 * draw(st.integers(1, half))
    batched = layout != "thd" and draw(st.booleans())
    rows = draw(st.sampled_from([1, b])) if batched else None
    shape = (rows, t) if batched else (t,)
    high = draw(st.sampled_from([16, 5000, 2**20]))
    seed = draw(st.integers(0, 2**16))
    positions = torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))
    if draw(st.booleans()):
        positions = positions.to(torch.int32)
    return dict(
        layout=layout, b=b, t=t, head_dim=head_dim, rotary=rotary, positions=positions, seed=seed,
        hq=draw(st.integers(1, 4)), hk=draw(st.integers(1, 3)),
        pairing=draw(st.sampled_from(PAIRINGS)), dtype=draw(st.sampled_from(DTYPES)),
        precision=draw(st.sampled_from(["float32", "exact"])), theta=draw(st.sampled_from([1e4, 5e5])),
    )


def to_bhtd(x, layout):
    if layout == "bthd":
        return x.transpose(1, 2)
    if layout == "thd":
        return x.transpose(0, 1)[None]
    return x


def make(c, heads, seed):
    g = torch.Generator().manual_seed(seed)
    shape = {"bhtd": (c["b"], heads, c["t"], c["head_dim"]), "bthd": (c["b"], c["t"], heads, c["head_dim"]),
             "thd": (c["t"], heads, c["head_dim"])}[c["layout"]]
    return torch.randn(shape, generator=g, dtype=torch.float64).to(c["dtype"])


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(cases())
def test_apply_matches_float64_oracle(c):
    rope = Rope(head_dim=c["head_dim"], rotary_dim=c["rotary"], base=c["theta"], pairing=c["pairing"])
    q, k = make(c, c["hq"], c["seed"]), make(c, c["hk"], c["seed"] + 1)
    q_before, k_before = q.clone(), k.clone()
    q2, k2 = rope.apply(q, k, c["positions"], layout=c["layout"], precision=c["precision"])
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs never mutated
    r = c["rotary"]
    inv = ref_inv_freq(c["theta"], r)
    pos = c["positions"].long()
    # float32 precision: the checkpoint convention float32(p) * inv_freq, rounded once; exact: float64 angles
    angles = pos.to(torch.float32)[..., None] * inv if c["precision"] == "float32" else None
    # float64 input meets float32 tables by design, so it gets the float32 tolerance
    tol = torch.float32 if c["dtype"] == torch.float64 else c["dtype"]
    for x, out in ((q, q2), (k, k2)):
        assert out.dtype == x.dtype and out.shape == x.shape
        x4, out4 = to_bhtd(x, c["layout"]), to_bhtd(out, c["layout"])
        expected = oracle(x4[..., :r], pos, inv, c["pairing"], angles=angles)
        assert_close(out4[..., :r], expected.to(x.dtype), dtype=tol)
        assert torch.equal(out4[..., r:], x4[..., r:])  # pass-through bit-identical
