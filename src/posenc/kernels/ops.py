"""The kernels as torch custom ops (`posenc::rope`, `posenc::rope_`), so autograd and `torch.compile` see them.

`posenc::rope` allocates and is differentiable: its backward is the same kernel rotating by -theta
(the transpose of a rotation is its inverse). `posenc::rope_` rotates in place (no autograd).
`angles` says where the angles come from: "table" (`cos`, `sin` are `[n, r/2]` rows indexed by `rows`),
or "float32" / "exact" (Triton only: `cos` carries `inv_freq [r/2]`, `rows` the positions, and the
kernel computes the angles, `factor` times cos/sin, as `posenc.rope.tables` does).
"""

from __future__ import annotations

import torch

__all__ = ["rope", "rope_", "launch"]


def launch(backend: str, q, k, q_out, k_out, cos, sin, rows, pairing: str, inverse: bool,
           angles: str = "table", factor: float = 1.0) -> None:
    """Run one backend's kernel on `[b, h, t, d]` views (q_out/k_out may be q/k)."""
    if backend == "cpu":
        from . import cpu

        if angles != "table":
            raise NotImplementedError("the cpu kernel reads tables")  # dispatch never asks for this
        ret = cpu.rope(q, k if k.shape[1] else None, q_out, k_out if k.shape[1] else None, cos,
                       sin.neg() if inverse else sin, rows, pairing)
        if ret != 0:  # dispatch checked the rows: out of range here means a bug, not bad input
            raise RuntimeError(f"posenc cpu kernel rejected the table rows (code {ret})")
    elif backend == "triton":
        from .triton_rope import rotate

        rotate(q, k, q_out, k_out, cos, sin, rows, pairing, inverse=inverse, angles=angles, factor=factor)
    else:
        raise ValueError(f"unknown backend {backend!r}")


@torch.library.custom_op("posenc::rope", mutates_args=())
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
         pairing: str, backend: str, inverse: bool, angles: str, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # same strides as q, k
    launch(backend, q, k, q_out, k_out, cos, sin, rows, pairing, inverse, angles, factor)
    return q_out, k_out


@rope.register_fake
def _(q, k, cos, sin, rows, pairing, backend, inverse, angles, factor):
    return torch.empty_like(q), torch.empty_like(k)


def _setup(ctx, inputs, output):
    _, _, cos, sin, rows, pairing, backend, inverse, angles, factor = inputs
    ctx.save_for_backward(cos, sin, rows)
    ctx.args = (pairing, backend, inverse, angles, factor)
    ctx.like = (inputs[0].new_empty(()).expand(inputs[0].shape), inputs[1].new_empty(()).expand(inputs[1].shape))


def _interleave(g: torch.Tensor, rotary: int) -> torch.Tensor:
    """Reorder the leading `rotary` channels from split-half `[first | second]` to pairs (2i, 2i+1)."""
    pairs = g[..., :rotary].unflatten(-1, (2, rotary // 2)).transpose(-1, -2).flatten(-2)  # [..., r]
    return torch.cat((pairs, g[..., rotary:]), dim=-1)


def _backward(ctx, grad_q, grad_k):
    cos, sin, rows = ctx.saved_tensors
    pairing, backend, inverse, angles, factor = ctx.args
    grad_q = torch.zeros_like(ctx.like[0]) if grad_q is None else grad_q  # an output that was not used
    grad_k = torch.zeros_like(ctx.like[1]) if grad_k is None else grad_k
    rotary = 2 * (cos.shape[-1] if angles == "table" else cos.shape[0])
    if pairing == "interleaved_to_split_half":  # outputs were written split-half, inputs read interleaved
        grad_q, grad_k, pairing = _interleave(grad_q, rotary), _interleave(grad_k, rotary), "interleaved"
    return (*rope(grad_q.contiguous(), grad_k.contiguous(), cos, sin, rows, pairing, backend, not inverse,
                  angles, factor), None, None, None, None, None, None, None, None)


rope.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("posenc::rope_", mutates_args=("q", "k"))
def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
          pairing: str, backend: str, angles: str, factor: float) -> None:
    launch(backend, q, k, q, k, cos, sin, rows, pairing, False, angles, factor)


@rope_.register_fake
def _(q, k, cos, sin, rows, pairing, backend, angles, factor):
    return None
