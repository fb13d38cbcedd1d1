"""Which keys each query of `posenc.attention` sees, and the fused implementations that take those masks.

Masks are logical (positions, not indices): `_visible` / `visibility` build the boolean `[b, 1, tq, tk]` mask
that eager attention and `sdpa_attention` use; `flex_score_mod` expresses the same masks (with a bias scheme
and a softcap) as a FlexAttention `score_mod`, which `_flex` runs.

Neighbours: `posenc.attention` (the entry point `attention` and its argument checks, which re-exports these
names) and `posenc.attention.encoding` (what an encoding does to q, k and the scores).
"""

from __future__ import annotations

import torch

from ..errors import fail

__all__ = ["visibility", "sdpa_attention", "flex_score_mod"]


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, key_mask: torch.Tensor | None,
             window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """`[b, 1, tq, tk]` bool: which keys each query may see (logical positions, not indices)."""
    b, tq, tk = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    visible = torch.ones(b, 1, tq, tk, dtype=torch.bool, device=q_pos.device)
    if causal:
        visible = visible & (k_pos[:, None, None, :] <= q_pos[:, None, :, None])  # [b, 1, tq, tk]
    if window is not None:  # the last `window` positions up to the query: q_pos - k_pos < window
        visible = visible & (q_pos[:, None, :, None] - k_pos[:, None, None, :] < window)
    if chunk is not None:  # Llama 4: the same chunk of positions, floor(q_pos / chunk) == floor(k_pos / chunk)
        visible = visible & (q_pos[:, None, :, None].div(chunk, rounding_mode="floor")
                             == k_pos[:, None, None, :].div(chunk, rounding_mode="floor"))
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    return visible


def visibility(q_positions: torch.Tensor, k_positions: torch.Tensor, key_mask: torch.Tensor | None = None,
               window: int | None = None, *, causal: bool = True,
               chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mask `sdpa_attention` takes, built once and shared by every layer of a forward.

    Args:
        q_positions: `[b, tq]` and k_positions `[b, tk]` int64 logical positions (checked by the caller).
        key_mask: `[b, tk]` bool or None; window, causal, chunk: as in `attention`.
    Returns:
        `(mask, seen)`: mask `[b, 1, tq, tk]` bool, True = attend, where a query row with no visible key
        sees every key (a finite softmax, zeroed after); seen `[b, 1, tq, 1]` bool (rows with a visible
        key). Always the general form: asking whether every row sees a key would be a host sync.
    """
    visible = _visible(q_positions, k_positions, causal, key_mask, window, chunk)  # [b, 1, tq, tk]
    seen = visible.any(-1, keepdim=True)  # [b, 1, tq, 1]
    return visible | ~seen, seen


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   seen: torch.Tensor | None, *, scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `scaled_dot_product_attention` over a mask from `visibility` (GQA without repeating k and v).

    Args:
        q: `[b, hq, tq, d]`; k `[b, hk, tk, d]`; v `[b, hk, tk, dv]` with `hq % hk == 0` (checked by the caller).
        mask, seen: from `visibility`; mask None means causal by index (`tq == tk` and key j sits at query
            j's position in every row: a fresh prefill without padding), which lets the kernel skip blocks.
        scale: multiplier on `q @ k^T`.
        bias: `[b or 1, hq, tq, tk]` additive scores (ALiBi, T5), or None (requires a mask).
    Returns:
        `[b, hq, tq, dv]` in q's dtype; rows with no visible key are zeros.
    """
    if bias is not None:  # float mask: the bias where visible, -inf elsewhere
        mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))  # [b, hq, tq, tk]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])  # [b, hq, tq, dv]
    return out if seen is None else out * seen


def _check_flex_backward(q, k, v, scheme) -> None:
    """flex_attention has no backward on CPU and refuses any input that requires grad (even under no_grad):
    refuse it here by name, before torch's NotImplementedError."""
    if q.device.type != "cpu":
        return
    params = scheme.parameters() if isinstance(scheme, torch.nn.Module) and torch.is_grad_enabled() else ()
    if any(t.requires_grad for t in (q, k, v, *params)):
        fail("impl", "'eager' or 'sdpa' when q, k or v require grad on cpu (flex_attention has no CPU backward; "
             "for forward only, pass tensors that do not require grad, e.g. under torch.no_grad())", "flex")


def _flex(q, k, v, q_pos, k_pos, scheme, causal, key_mask, scale, window=None, chunk=None,
          softcap=None) -> torch.Tensor:
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:  # pragma: no cover - torch < 2.5
        fail("impl", "'eager' or 'sdpa' (this torch has no flex_attention)", "flex")
    score_mod = flex_score_mod(q_pos, k_pos, scheme, causal, key_mask, window, chunk, softcap)
    groups = q.shape[1] // k.shape[1]
    return flex_attention(q, k, v, score_mod=score_mod, scale=scale, enable_gqa=groups > 1)  # [b, hq, tq, dv]


def flex_score_mod(q_pos, k_pos, scheme, causal, key_mask=None, window=None, chunk=None, softcap=None):
    """The FlexAttention `score_mod` of `attention`: bias from positions, then the logical masks.

    Args:
        q_pos: int64 `[b, tq]` positions of the queries, indexed by `q_idx`.
        k_pos: int64 `[b, tk]` positions of the keys, indexed by `kv_idx` (under context parallelism:
            the gathered keys' global positions, so the bias and masks follow the engine's layout).
        scheme: a bias scheme (`bias`/`score_mod`) or None; causal, key_mask `[b, tk]`, window, chunk, softcap:
            as `attention` (checked by the caller).
    Returns:
        `score_mod(score, b, h, q_idx, kv_idx)`.
    """
    bias_mod = scheme.score_mod(q_pos, k_pos) if scheme is not None else None

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:  # flex has already scaled the score
            score = torch.tanh(score / softcap) * softcap
        if bias_mod is not None:
            score = bias_mod(score, b, h, q_idx, kv_idx)
        # python-float -inf, not a captured 0-d tensor: inductor's CPU flex template rejects 0-d buffers
        if causal:
            score = torch.where(k_pos[b, kv_idx] <= q_pos[b, q_idx], score, float("-inf"))
        if key_mask is not None:
            score = torch.where(key_mask[b, kv_idx], score, float("-inf"))
        if window is not None:
            score = torch.where(q_pos[b, q_idx] - k_pos[b, kv_idx] < window, score, float("-inf"))
        if chunk is not None:
            q_chunk = q_pos[b, q_idx].div(chunk, rounding_mode="floor")
            same = q_chunk == k_pos[b, kv_idx].div(chunk, rounding_mode="floor")
            score = torch.where(same, score, float("-inf"))
        return score

    return score_mod
