"""The reference rotation: plain torch, runs anywhere, differentiable, the oracle for every kernel.

Pairings (which channels form a rotation pair, for a rotary width r):
- `"split_half"` (GPT-NeoX, Llama in transformers): channel i pairs with i + r/2.
- `"interleaved"` (GPT-J, Meta's original Llama, Cohere, GLM): channel 2i pairs with 2i + 1.
- `"interleaved_to_split_half"` (DeepSeek-V3 with `rope_interleave`): pairs are read interleaved and
  written split-half, `[x_even c - x_odd s | x_odd c + x_even s]`. Valid because q and k share it.

The rotary channels are the leading `r = 2 * cos.shape[-1]` channels; the rest pass through bit-identical.
The rotation runs in float32 (float64 for float64 input) and returns the input's dtype.

    >>> import torch
    >>> x = torch.tensor([[[[1.0, 0.0]]]])            # [b=1, h=1, t=1, d=2]
    >>> cos, sin = torch.tensor([[0.0]]), torch.tensor([[1.0]])   # 90 degrees, [t=1, r/2=1]
    >>> apply_rope(x, cos, sin).flatten().tolist()
    [0.0, 1.0]
"""

from __future__ import annotations

from typing import Literal

import torch

from ..errors import Raw, check_float_tensor, choice, fail

__all__ = ["apply_rope", "check_table", "PAIRINGS", "LAYOUTS"]

Pairing = Literal["split_half", "interleaved", "interleaved_to_split_half"]
PAIRINGS = ("split_half", "interleaved", "interleaved_to_split_half")
# layout -> (rank of x, axis of tokens counted from the end, axis of heads counted from the end or None)
LAYOUTS = {"bhtd": (4, -2, -3), "bthd": (4, -3, -2), "thd": (3, -3, -2), "td": (2, -2, None)}


def resolve_pairing(interleaved: bool | str = False, pairing: str | None = None) -> str:
    """The pairing name from the `interleaved` flag or an explicit `pairing`."""
    if pairing is None:
        if isinstance(interleaved, str):
            pairing = interleaved
        elif isinstance(interleaved, bool):
            pairing = "interleaved" if interleaved else "split_half"
        else:
            fail("interleaved", "a bool", interleaved)
    return choice("pairing", pairing, PAIRINGS)


def broadcast_table(table: torch.Tensor, x: torch.Tensor, layout: str) -> torch.Tensor:
    """Reshape a `[t, r/2]` or `[b, t, r/2]` table so it broadcasts against `x` in `layout`."""
    head_axis = LAYOUTS[layout][2]
    if head_axis is not None:
        table = table.unsqueeze(head_axis)  # [b?, 1, t, r/2] for bhtd; [b?, t, 1, r/2] for bthd and thd
    return table


def check_table(cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor, layout: str) -> None:
    """Raise `PosencError` unless `cos`/`sin` are per-pair tables that fit `x` in `layout` without reshaping it."""
    check_float_tensor("cos", cos)
    check_float_tensor("sin", sin)
    if cos.shape != sin.shape:
        fail("sin", f"the shape of cos {tuple(cos.shape)}", sin)
    batched = LAYOUTS[layout][2] is not None and LAYOUTS[layout][0] == 4  # only bhtd / bthd have a batch axis
    if cos.ndim not in ((2, 3) if batched else (2,)):
        fail("cos", "a per-pair table [t, r/2]" + (" or [b, t, r/2]" if batched else f" (layout {layout!r})"), cos)
    if 2 * cos.shape[-1] > x.shape[-1]:
        fail("cos", f"at most d/2 = {x.shape[-1] // 2} columns (one per rotation pair)", cos)
    t = x.shape[LAYOUTS[layout][1]]
    if cos.shape[-2] not in (1, t):
        fail("cos", f"{t} rows (one per token of x) or 1", cos)
    if cos.ndim == 3 and cos.shape[0] not in (1, x.shape[0]):
        fail("cos", f"batch size 1 or {x.shape[0]} (as x)", cos)
    if cos.device != x.device or sin.device != x.device:
        fail("cos", f"tables on the device of x ({x.device})", Raw(f"cos on {cos.device}, sin on {sin.device}"))


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    *,
    pairing: str | None = None,
    layout: str = "bhtd",
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotate the leading `2 * cos.shape[-1]` channels of `x` by the angles whose cos/sin are given.

    Args:
        x: `[b, h, t, d]` (layout "bhtd"), `[b, t, h, d]` ("bthd"), packed `[t, h, d]` ("thd") or `[t, d]` ("td").
        cos, sin: per-pair tables `[t, r/2]` or `[b, t, r/2]` (as `Rope.cos_sin` returns), r <= d.
        interleaved: pair channels (2i, 2i+1) instead of (i, i + r/2).
        pairing: explicit pairing name (overrides `interleaved`), see the module docstring.
        layout: where the token and head axes are.
        compute_dtype: the dtype the rotation runs in. Default: float32 (float64 for float64 input), so a
            bf16/fp16 result is rounded once. `compute_dtype=x.dtype` rounds the tables and every product
            and sum to x's dtype as transformers' Llama-family models (and GLM, DeepSeek-V3, gpt-oss, Qwen2-VL) do in
            bf16/fp16, which reproduces their output bit for bit; that output is up to ~1.5x the bf16 tolerance
            (1e-2 + 1.6e-2 |y|) away from the float32 result on randn inputs.
    Returns:
        The rotated tensor, same shape and dtype as `x`; channels past r are returned unchanged.
    Raises:
        PosencError: on a non-float `x`, an unknown layout or pairing, or tables that do not fit `x`
            (wrong rank, width, token count, batch size or device).

    Example (a 90-degree turn of the pair (x0, x2), split-half pairing, rotary width 4 of d = 6):
        >>> import torch
        >>> x = torch.tensor([[1.0, 0.0, 0.0, 0.0, 5.0, 6.0]])          # [t=1, d=6], layout "td"
        >>> cos, sin = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])   # [t=1, r/2=2]
        >>> apply_rope(x, cos, sin, layout="td").tolist()
        [[0.0, 0.0, 1.0, 0.0, 5.0, 6.0]]
    """
    pairing = resolve_pairing(interleaved, pairing)
    choice("layout", layout, tuple(LAYOUTS))
    check_float_tensor("x", x, ndim=(LAYOUTS[layout][0],))
    check_table(cos, sin, x, layout)
    half = cos.shape[-1]
    rotary = 2 * half
    if compute_dtype is None:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    elif isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point:
        compute = compute_dtype
    else:
        fail("compute_dtype", "None or a floating-point torch.dtype", compute_dtype)
    c = broadcast_table(cos, x, layout).to(compute)
    s = broadcast_table(sin, x, layout).to(compute)
    x_rot = x[..., :rotary].to(compute)
    if pairing == "interleaved":
        even, odd = x_rot[..., 0::2], x_rot[..., 1::2]  # [..., r/2] each
        out = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)  # [..., r]
    else:
        if pairing == "split_half":
            first, second = x_rot[..., :half], x_rot[..., half:]
        else:  # interleaved_to_split_half: read pairs (2i, 2i+1), write [first | second]
            first, second = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.cat((first * c - second * s, second * c + first * s), dim=-1)  # [..., r]
    out = out.to(x.dtype)
    if rotary == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary:]), dim=-1)
