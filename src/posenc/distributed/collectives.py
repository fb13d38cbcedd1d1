"""The few collectives the reference attention needs, on stock `torch.distributed` (gloo or NCCL).

Autograd through collectives deadlocks when ranks build different graphs, so every differentiable op
here is ONE autograd node per call whose backward is ONE collective, and callers make the sequence of
calls independent of the data. Integer side data (positions, masks) travels with the same call but
outside autograd. `torch.distributed` is only touched when a function runs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import fail

__all__ = ["group_size_rank", "ring_shift", "all_gather_seq", "seq_to_heads", "heads_to_seq",
           "global_max", "all_reduce_grads"]


def group_size_rank(group: Any = None) -> tuple[int, int]:
    """`(size, rank)` of this process in `group` (default: the world).

    Raises:
        PosencError: when no default process group is initialised.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        fail("group", "an initialised torch.distributed process group (call init_process_group first)", group)
    return dist.get_world_size(group), dist.get_rank(group)


def _global_rank(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _shift(tensors: Sequence[torch.Tensor], group: Any, step: int) -> list[torch.Tensor]:
    """Send each tensor to rank + step and receive the same shapes from rank - step (one batched exchange)."""
    import torch.distributed as dist

    size, rank = group_size_rank(group)
    dst, src = _global_rank(group, (rank + step) % size), _global_rank(group, (rank - step) % size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, src, group) for r in received]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _RingShift(torch.autograd.Function):
    """Float payload to the next rank (backward: its gradient to the previous one), side data alongside."""

    @staticmethod
    def forward(ctx, group, payload, side):  # payload [...] float, side [...] int64
        ctx.group = group
        received, received_side = _shift([payload, side], group, +1)
        ctx.mark_non_differentiable(received_side)
        return received, received_side

    @staticmethod
    def backward(ctx, grad, _grad_side):
        (back,) = _shift([grad.contiguous()], ctx.group, -1)
        return None, back, None


def ring_shift(payload: torch.Tensor, side: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass `payload` (differentiable) and `side` (integer data) one step around the ring, together.

    Returns:
        `(payload, side)` from rank - 1; the payload's gradient flows back to the rank it came from.
    """
    return _RingShift.apply(group, payload, side)


def all_gather_seq(x: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (no autograd; for positions and masks)."""
    import torch.distributed as dist

    size, _ = group_size_rank(group)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _all_to_all(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks.contiguous(), group=group)
    return out


def _pack_by_rank(tensors: Sequence[torch.Tensor], size: int) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """Split each `[b, h, t, d]` tensor into `size` head groups and lay them out as `[size, n]` (one row per rank)."""
    shapes = []
    rows = []
    for x in tensors:
        b, h, t, d = x.shape
        groups = x.reshape(b, size, h // size, t, d).transpose(0, 1)  # [W, b, h/W, t, d]
        shapes.append(tuple(groups.shape[1:]))
        rows.append(groups.reshape(size, -1))  # [W, n_x]
    return torch.cat(rows, dim=1), shapes  # [W, n]


def _unpack_by_rank(packed: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Inverse of `_pack_by_rank` after the exchange: row j holds rank j's tokens of my heads."""
    size = packed.shape[0]
    out, offset = [], 0
    for b, h, t, d in shapes:
        n = b * h * t * d
        x = packed[:, offset:offset + n].reshape(size, b, h, t, d)  # [W(source), b, h/W, t, d]
        out.append(x.permute(1, 2, 0, 3, 4).reshape(b, h, size * t, d))  # [b, h/W, W t, d]
        offset += n
    return out


def _seq_to_heads(tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    size, _ = group_size_rank(group)
    packed, shapes = _pack_by_rank(tensors, size)  # [W, n]
    return _unpack_by_rank(_all_to_all(packed, group), shapes)


def _heads_to_seq(tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    size, _ = group_size_rank(group)
    rows, shapes = [], []
    for x in tensors:
        b, h, t, d = x.shape
        per_rank = x.reshape(b, h, size, t // size, d).permute(2, 0, 1, 3, 4)  # [W(dest), b, h/W, t/W, d]
        shapes.append((b, h, t // size, d))
        rows.append(per_rank.reshape(size, -1))
    exchanged = _all_to_all(torch.cat(rows, dim=1), group)  # [W(source), n]
    out, offset = [], 0
    for b, h, t, d in shapes:
        n = b * h * t * d
        x = exchanged[:, offset:offset + n].reshape(size, b, h, t, d)  # [W(source head group), b, h/W, t/W, d]
        out.append(x.transpose(0, 1).reshape(b, size * h, t, d))  # [b, h, t/W, d]
        offset += n
    return out


class _Ulysses(torch.autograd.Function):
    """One all-to-all in either direction; its backward is one all-to-all in the other direction."""

    @staticmethod
    def forward(ctx, group, to_heads, *tensors):
        ctx.group, ctx.to_heads = group, to_heads
        return tuple((_seq_to_heads if to_heads else _heads_to_seq)(tensors, group))

    @staticmethod
    def backward(ctx, *grads):
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return (None, None, *back([g.contiguous() for g in grads], ctx.group))


def _check_heads(tensors: Sequence[torch.Tensor], size: int, arg: str) -> None:
    for i, x in enumerate(tensors):
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] % size:
            fail(f"{arg}[{i}]", f"a [b, h, t, d] tensor with h divisible by the group size {size}", x)


def seq_to_heads(*tensors: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, ...]:
    """Ulysses all-to-all: `[b, h, t/W, d]` sequence shards -> `[b, h/W, t, d]` head groups (one exchange).

    The gathered sequence is the rank-ordered concatenation of shards (whatever the layout); rank r gets
    heads `head_slice(h, W, r)`. Differentiable; the backward is `heads_to_seq`.
    """
    size, _ = group_size_rank(group)
    _check_heads(tensors, size, "tensors")
    return _Ulysses.apply(group, True, *tensors)


def heads_to_seq(*tensors: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, ...]:
    """Inverse of `seq_to_heads`: `[b, h/W, t, d]` -> `[b, h, t/W, d]` (one exchange, differentiable)."""
    size, _ = group_size_rank(group)
    for i, x in enumerate(tensors):
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[2] % size:
            fail(f"tensors[{i}]", f"a [b, h, t, d] tensor with t divisible by the group size {size}", x)
    return _Ulysses.apply(group, False, *tensors)


def global_max(value: int, group: Any = None, device: torch.device | str | None = None) -> int:
    """The maximum of an integer over the group (a collective: call it on every rank; NCCL needs `device`)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def all_reduce_grads(parameters: Any, group: Any = None) -> None:
    """Sum the gradients of replicated parameters (T5 table, learned slopes) over the group, in place.

    Context parallelism replicates position-bias parameters, so each rank holds only its queries'
    share of the gradient; a trainer must sum over the CP ranks (FSDP over a mesh that includes CP
    does it). Parameters without a gradient contribute zeros, so every rank runs the same collectives.
    """
    import torch.distributed as dist

    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
