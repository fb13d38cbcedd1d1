"""`apply_`'s memory check (`posenc.rope.aliasing.written_twice`) against the addresses themselves.

The oracle: a buffer holding its own storage index at every element; a view's values are then the storage
indices it covers, and q and k share memory exactly when those sets meet (or when a view repeats an index).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc import PosencError, Rope
from posenc.rope.aliasing import _offset_reachable, overlaps_itself, written_twice


def aliased(q: torch.Tensor, k: torch.Tensor) -> bool:
    return written_twice(q, k) is not None


def shares(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The oracle: q and k are views of `indexed(...)`; their values are storage indices."""
    qi, ki = q.flatten().tolist(), k.flatten().tolist()
    return len(set(qi)) < len(qi) or len(set(ki)) < len(ki) or bool(set(qi) & set(ki))


def indexed(*shape: int) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape)


def test_views_offset_in_two_dims_share_memory_and_apply_refuses_them():
    # q = x[:, 0:2, 1:3] and k = x[:, 1:3, 0:2] have one shape and strides, and share x[:, 1, 1] (q's (1, 0),
    # k's (0, 1)): a shifted-by-one check per dimension missed it and rotated that element twice
    x = indexed(1, 4, 4, 16)
    q, k = x[:, 0:2, 1:3], x[:, 1:3, 0:2]
    assert shares(q, k) and aliased(q, k)
    rope, pos = Rope(head_dim=16), torch.arange(2)
    for impl in (None, "reference", "cpu"):
        y = torch.randn(1, 4, 4, 16)
        before = y.clone()
        with pytest.raises(PosencError, match="k: expected a tensor that shares no memory with q"):
            rope.apply_(y[:, 0:2, 1:3], y[:, 1:3, 0:2], pos, impl=impl)
        assert torch.equal(y, before), impl  # nothing written


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_gqa_heads_split_from_one_fused_projection_rotate_in_place(layout):
    # a fused projection [b, t, (hq + hk + hk) * d] viewed per head: q and k are disjoint views with different
    # head counts, which an earlier check refused as "a view of q's memory"
    b, t, hq, hk, d = 2, 5, 4, 2, 16
    rope, pos = Rope(head_dim=d), torch.arange(t)
    qkv = torch.randn(b, t, (hq + 2 * hk) * d).view(b, t, hq + 2 * hk, d)
    if layout == "bhtd":
        qkv = qkv.transpose(1, 2)  # [b, heads, t, d] over the same memory
    heads = 1 if layout == "bhtd" else 2
    q, k, v = qkv.split([hq, hk, hk], dim=heads)
    assert not aliased(q, k)
    expected = rope.apply(q, k, pos, layout=layout, impl="reference")
    v0 = v.clone()
    out = rope.apply_(q, k, pos, layout=layout)
    assert out[0] is q and out[1] is k
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1]) and torch.equal(v, v0)


def test_offset_search_is_exact_and_bounded():
    assert _offset_reachable(5, [(4, 0, 1), (1, -1, 1)], 100)  # 4 + 1
    assert not _offset_reachable(7, [(4, 0, 1), (1, -1, 1)], 100)  # 4 + 3 and 8 - 1 are out of range
    assert _offset_reachable(-3, [(4, -1, 0), (1, 0, 1)], 100)  # -4 + 1
    # strides that do not nest (6 and 4 both reach 12): more than one candidate at a level, still exact
    assert _offset_reachable(2, [(6, -2, 2), (4, -2, 2)], 100)  # 6 - 4
    assert not _offset_reachable(1, [(6, -2, 2), (4, -2, 2)], 100)  # 6a + 4b is even
    assert _offset_reachable(1, [(6, -2, 2), (4, -2, 2)], 1) is None  # past the budget: undecided


def _views(draw, x: torch.Tensor) -> torch.Tensor:
    """A random view of x: a slice with a step in every dimension, maybe two dimensions swapped."""
    index = []
    for n in x.shape:
        start = draw(st.integers(0, n - 1))
        stop = draw(st.integers(start + 1, n))
        index.append(slice(start, stop, draw(st.integers(1, 2))))
    v = x[tuple(index)]
    if draw(st.booleans()):
        a, b = draw(st.permutations(range(v.ndim)))[:2]
        v = v.transpose(a, b)
    return v


@st.composite
def view_pairs(draw):
    shape = draw(st.lists(st.integers(1, 5), min_size=2, max_size=4))
    x = indexed(*shape)
    if draw(st.booleans()):  # a view of a view of a larger, permuted buffer
        x = x.permute(*draw(st.permutations(range(len(shape)))))
    return _views(draw, x), _views(draw, x)


@st.composite
def strided_views(draw, buffer: torch.Tensor):
    """Any sizes and strides that stay inside the buffer: dense, gapped or meeting themselves."""
    ndim = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    strides = draw(st.lists(st.integers(0, 12), min_size=ndim, max_size=ndim))
    reach = sum((n - 1) * s for n, s in zip(sizes, strides))
    offset = draw(st.integers(0, max(0, buffer.numel() - 1 - reach)))
    if offset + reach >= buffer.numel():
        sizes = [1] * ndim
    return buffer.as_strided(sizes, strides, offset)


@settings(max_examples=300, deadline=None)
@given(view_pairs())
def test_aliased_equals_the_address_oracle_on_random_views(pair):
    q, k = pair
    assert aliased(q, k) == shares(q, k), (q.shape, q.stride(), k.shape, k.stride(), k.data_ptr() - q.data_ptr())


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_aliased_and_overlaps_itself_equal_the_oracle_on_any_strides(data):
    buffer = indexed(200)
    q, k = data.draw(strided_views(buffer)), data.draw(strided_views(buffer))
    for x in (q, k):
        qi = x.flatten().tolist()
        assert overlaps_itself(x) == (len(set(qi)) < len(qi)), (x.shape, x.stride())
    assert aliased(q, k) == shares(q, k), (q.shape, q.stride(), k.shape, k.stride(), k.data_ptr() - q.data_ptr())
