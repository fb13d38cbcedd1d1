"""One forward's attention for the decoder: `attend(q, k, v, window, chunk=None, sinks=None)`, its masks built
once from logical positions and shared by every layer.

    >>> import torch
    >>> positions = torch.tensor([[0, 1, 2]])
    >>> attend = forward_attention("sdpa", 1.0, None, None, positions, positions, torch.ones(1, 3, dtype=torch.bool))
    >>> q = torch.ones(1, 1, 3, 2)
    >>> attend(q, q, torch.arange(3.0).view(1, 1, 3, 1), None)[0, 0, :, 0].tolist()
    [0.0, 0.5, 1.0]
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..attention import attention, sdpa_attention, visibility
from ..errors import rename

__all__ = ["forward_attention"]


def forward_attention(impl: str, scale: float, softcap: float | None, scheme: Any, positions: torch.Tensor,
                      key_positions: torch.Tensor, key_mask: torch.Tensor) -> Callable[..., torch.Tensor]:
    """This forward's attention, `attend(q, k, v, window, chunk=None, sinks=None) -> [b, hq, t, d]`.

    Args:
        impl: "sdpa", "eager" or "flex" (the decoder's `attn_impl`).
        scale: the softmax scale. softcap: a score soft-cap or None. scheme: a bias scheme (ALiBi, T5) or None.
        positions: `[b, t]` logical positions of the queries; key_positions `[b, w]` of the keys, key_mask
            `[b, w]` the keys that exist.
    Returns:
        "sdpa" without a bias scheme: one boolean mask per distinct (window, chunk), built on first use and shared
        across layers (none for a fresh prefill without padding: causal by index); "eager", "flex" and bias
        schemes go through `posenc.attention.attention` per layer.
    """
    if impl != "sdpa" or scheme is not None:
        def attend(q, k, v, window, chunk=None, sinks=None):
            with rename({"impl": "attn_impl"}):  # the decoder's name for the choice
                return attention(q, k, v, q_positions=positions, k_positions=key_positions, encoding=scheme,
                                 key_mask=key_mask, scale=scale, impl=impl, window=window, chunk=chunk,
                                 softcap=softcap, sinks=sinks)
        return attend
    masks: dict[tuple[int | None, int | None], tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    if positions.shape[1] == key_positions.shape[1] and torch.equal(positions, key_positions) \
            and bool(key_mask.all()):  # a fresh prefill without padding: causal by index, no mask
        masks[None, None] = (None, None)

    def attend(q, k, v, window, chunk=None, sinks=None):  # sinks: refused with sdpa by the decoder's attn_impl
        if (window, chunk) not in masks:
            masks[window, chunk] = visibility(positions, key_positions, key_mask, window, chunk=chunk)  # [b, 1, t, w]
        return sdpa_attention(q, k, v, *masks[window, chunk], scale=scale)  # [b, hq, t, d]
    return attend
