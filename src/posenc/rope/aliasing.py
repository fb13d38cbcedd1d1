"""Whether q and k share memory: `apply_` writes both, and would rotate a shared element twice."""

from __future__ import annotations

import torch

from ..errors_tensors import transformed

__all__ = ["aliased"]


def _extent(shape, stride, elem: int) -> int:
    """Bytes from a tensor's first element to one past its last (0 when it has no elements)."""
    if 0 in shape:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride))) * elem


def aliased(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether rotating q and k in place would write some memory twice.

    True when q or k has a broadcast (stride-0) dimension, or when some element of q is an element of k:
    decided exactly when their memory ranges meet and they have the same sizes and strides (views of one
    buffer, e.g. q and k split from a fused qkv projection: disjoint), else taken as disjoint when the
    ranges do not meet, and as aliased when they do. Under a torch.func transform (vmap, grad) the wrappers
    have no addresses: False (the transform's own in-place rules apply).
    """
    if transformed(q, k):
        return False
    if q.is_contiguous() and k.is_contiguous():  # no broadcast dimension: disjoint unless the ranges meet
        qp, kp = q.data_ptr(), k.data_ptr()
        if qp + q.numel() * q.element_size() <= kp or kp + k.numel() * k.element_size() <= qp:
            return False
    for x in (q, k):
        if any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride())):
            return True
    q_end, k_end = _extent(q.shape, q.stride(), q.element_size()), _extent(k.shape, k.stride(), k.element_size())
    qp, kp = q.data_ptr(), k.data_ptr()
    if not q_end or not k_end or qp >= kp + k_end or kp >= qp + q_end:
        return False
    if q.shape != k.shape or q.stride() != k.stride() or q.element_size() != k.element_size():
        return True  # ranges meet and the layouts differ: not worth deciding
    delta = abs(kp - qp)  # bytes: is it the offset of some element of q (an index vector within the sizes)?
    for n, st in sorted(zip(q.shape, q.stride()), key=lambda d: -d[1]):
        step = st * q.element_size()
        if step:
            m = min(delta // step, n - 1)
            delta -= m * step
    return delta == 0
