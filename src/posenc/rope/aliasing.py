"""Whether q and k share memory, or either overlaps itself: `apply_` writes both, and would rotate such an
element twice."""

from __future__ import annotations

import torch

from ..errors.tensors import transformed

__all__ = ["written_twice", "shares_memory", "overlaps_itself"]

SEARCH_BUDGET = 4096  # index combinations tried before an undecided case is taken as shared (refused)


def _extent(shape, stride, elem: int) -> int:
    """Bytes from a tensor's first element to one past its last (0 when it has no elements)."""
    if 0 in shape:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride))) * elem


def written_twice(q: torch.Tensor, k: torch.Tensor) -> tuple[str, str] | None:
    """Why rotating q and k in place would write some memory twice: (argument, "itself" or "q"), else None.

    ("q" or "k", "itself") for a tensor that overlaps itself (`overlaps_itself`: a broadcast dimension, rows
    made to meet by `as_strided`); ("k", "q") for one that shares an element with q (`shares_memory`). Under a
    torch.func transform (vmap, grad) the wrappers have no addresses: None (the transform's own in-place rules
    apply).
    """
    if transformed(q, k):
        return None
    for arg, x in (("q", q), ("k", k)):
        if overlaps_itself(x):
            return arg, "itself"
    return ("k", "q") if shares_memory(q, k) else None


def shares_memory(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether some element of q is an element of k (q and k each without repeated elements).

    When their memory ranges do not meet: False at once. When they meet (views of one buffer, e.g. q and k
    split by heads or channels from a fused qkv projection, GQA included), decided exactly: is k's offset from
    q, in elements, `sum(i_d * q.stride(d)) - sum(j_d * k.stride(d))` for some index vectors i of q and j of k
    (`_offset_reachable`)? True when that is not cheap to decide (more than SEARCH_BUDGET index combinations,
    different element sizes, or offsets off the element grid).
    """
    if q.is_contiguous() and k.is_contiguous():  # (the common case) disjoint unless the ranges meet
        qp, kp = q.data_ptr(), k.data_ptr()
        if qp + q.numel() * q.element_size() <= kp or kp + k.numel() * k.element_size() <= qp:
            return False
    q_end, k_end = _extent(q.shape, q.stride(), q.element_size()), _extent(k.shape, k.stride(), k.element_size())
    qp, kp = q.data_ptr(), k.data_ptr()
    if not q_end or not k_end or qp >= kp + k_end or kp >= qp + q_end:
        return False
    elem = q.element_size()
    if k.element_size() != elem or (kp - qp) % elem:
        return True  # ranges meet and elements may overlap in part: not worth deciding
    # q's element i sits at qp + sum(i_d * sq_d), k's element j at kp + sum(j_d * sk_d): one address for both
    # when sum(i_d * sq_d) - sum(j_d * sk_d) = (kp - qp) / elem. Dimensions of one stride add their ranges.
    ranges: dict[int, list[int]] = {}  # stride -> [lo, hi] of the summed index differences
    for n, st in zip(q.shape, q.stride()):
        if n > 1:
            ranges.setdefault(st, [0, 0])[1] += n - 1  # q's indices widen the top
    for n, st in zip(k.shape, k.stride()):
        if n > 1:
            ranges.setdefault(st, [0, 0])[0] -= n - 1  # k's the bottom
    dims = [(st, lo, hi) for st, (lo, hi) in sorted(ranges.items(), reverse=True)]
    found = _offset_reachable((kp - qp) // elem, dims, SEARCH_BUDGET)
    return True if found is None else found


def overlaps_itself(x: torch.Tensor) -> bool:
    """Whether two elements of x are one address: a broadcast (stride-0) dimension, or rows `as_strided` made
    to meet. torch's own in-place ops let the latter run (their result then depends on the order of the
    writes); a rotation would read elements it already wrote, so `apply_` refuses both. Decided exactly, as
    in `shares_memory`; undecided past SEARCH_BUDGET tries: True."""
    if x.is_contiguous():
        return False
    dims = sorted(((st, n) for n, st in zip(x.shape, x.stride()) if n > 1), reverse=True)  # by stride, largest first
    if dims and dims[-1][0] == 0:
        return True
    span = 0  # nested strides, each beyond what the smaller ones reach (any dense layout): no overlap
    for st, n in reversed(dims):
        if st <= span:
            break
        span += (n - 1) * st
    else:
        return False
    for p, (st, n) in enumerate(dims):  # the largest-stride index difference that is not 0: dims[p]'s, > 0
        rest = [(s, 1 - m, m - 1) for s, m in dims[p + 1:]]
        found = _offset_reachable(0, [(st, 1, n - 1), *rest], SEARCH_BUDGET)
        if found is None or found:
            return True
    return False


def _offset_reachable(delta: int, dims: list[tuple[int, int, int]], budget: int) -> bool | None:
    """Whether delta = sum(e_d * stride_d) for integers lo_d <= e_d <= hi_d (dims by decreasing stride > 0).

    A depth-first search that tries, at each dimension, only the e_d that leave a remainder the smaller
    strides can still reach (at most a few for the layouts of real tensors); None when it would try more than
    `budget` combinations.
    """
    low, high = [0] * (len(dims) + 1), [0] * (len(dims) + 1)  # what dims[i:] can reach together
    for i in range(len(dims) - 1, -1, -1):
        st, lo, hi = dims[i]
        low[i], high[i] = low[i + 1] + lo * st, high[i + 1] + hi * st
    tried = 0
    stack = [(0, delta)]
    while stack:
        i, rest = stack.pop()
        if i == len(dims):
            if rest == 0:
                return True
            continue
        st, lo, hi = dims[i]
        first = max(lo, -((high[i + 1] - rest) // st))  # the least e with rest - e * st <= high[i + 1]
        last = min(hi, (rest - low[i + 1]) // st)  # the largest e with rest - e * st >= low[i + 1]
        tried += max(0, last - first + 1)
        if tried > budget:
            return None
        stack.extend((i + 1, rest - e * st) for e in range(first, last + 1))
    return False
