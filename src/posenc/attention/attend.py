"""Reference attention (MHA / GQA) that takes any positional encoding as a value, with explicit positions.

The encoding decides what happens to q, k and the scores:
- `None`: q and k are used as given (for example already rotated, or keys rotated in a cache).
- a `posenc.Rope`: q is rotated at `q_positions`, k at `k_positions` (so cached keys can sit at any position),
  both with ONE table per batch row: that of the forward's length, `max(q and k positions of the row) + 1`,
  as a full forward over the row computes it. So under length-dependent scalings (dynamic NTK, LongRoPE)
  the scores still depend on relative positions only, also when keys lie after every query
  (non-causal attention, chunked calls). Each row uses its own length: a row never depends on its
  batch-mates (transformers takes the batch maximum; for `[t]` positions the two agree).
- a bias scheme (`posenc.ALiBi`, `posenc.T5RelativeBias`, or anything with `bias(q_positions, k_positions)`
  and `score_mod(q_positions, k_positions)`): the bias is added to the scaled scores.
- an absolute scheme (`posenc.Sinusoidal`, `posenc.LearnedPositions`, or anything with
  `embedding(positions) -> [..., d]`): the embedding of each position is added to q and to k.

Masks are logical too: `causal=True` hides every key whose position is above the query's position (not
its index), `key_mask` hides padding or empty cache slots, `window` keeps the last `window` positions and
`chunk` keeps the keys in the query's chunk of positions (Llama 4's chunked layers). A query row with no
visible key returns zeros, never NaN. Two score changes some families make are values too: `temperature`
(a `QueryTemperature`: q times a factor of its position, after the encoding) and `softcap` (Gemma 2:
scaled scores `s -> softcap * tanh(s / softcap)` before the mask).

Implementations (`impl`), chosen out loud; an explicit choice never falls back:
- `"eager"`: plain torch, the oracle (float32 math for half inputs, float64 for float64).
- `"sdpa"`: fused `torch.nn.functional.scaled_dot_product_attention` with a boolean mask (a float mask
  when a bias scheme adds scores); GQA without repeating keys and values.
- `"flex"`: `torch.nn.attention.flex_attention` with a `score_mod` computed from the positions; no
  `[tq, tk]` bias tensor is built by posenc. Outside `torch.compile` PyTorch runs it unfused (and says so).

The entry point and its argument checks live here; what an encoding does to q and k is in
`posenc.attention.encoding`, the logical masks and the fused sdpa / flex paths in `posenc.attention.masks`.

    >>> import torch, posenc
    >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    >>> out = attention(q, k, v, q_positions=torch.arange(2, 5), k_positions=torch.arange(5),
    ...                 encoding=posenc.Rope(head_dim=8))
    >>> out.shape
    torch.Size([1, 4, 3, 8])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .encoding import _bias_4d, apply_temperature, check_encoding, encode_qk
from .masks import _check_flex_backward, _flex, sdpa_attention, visibility
from ..errors import batch_positions, check_float_tensor, choice, fail, integer, real
from ..rope.temperature import QueryTemperature

__all__ = ["attention", "ATTENTION_IMPLS", "check_inputs", "check_score_options"]

ATTENTION_IMPLS = ("eager", "sdpa", "flex")


def check_inputs(q, k, v, q_positions, k_positions, key_mask=None, scale=None, window=None):
    """Check the arguments `attention` shares with its distributed forms; return `(q_pos, k_pos, scale)`.

    Returns:
        int64 `[b, tq]` and `[b, tk]` positions and the float scale (default `1 / sqrt(d)`).
    Raises:
        PosencError: as `attention` (shapes, GQA heads, window, scale, positions, key_mask).
    """
    check_float_tensor("q", q, ndim=(4,))
    for name, x in (("k", k), ("v", v)):
        check_float_tensor(name, x, ndim=(4,), like=("q", q))
    b, hq, tq, d = q.shape
    if k.shape[0] != b or k.shape[-1] != d:
        fail("k", f"shape [b={b}, hk, tk, d={d}] (as q {tuple(q.shape)})", k)
    hk, tk = k.shape[1], k.shape[2]
    if v.shape[:3] != k.shape[:3]:
        fail("v", f"shape [{b}, {hk}, {tk}, dv] (as k)", v)
    if hk == 0 or hq % hk:
        fail("k", f"a head count that divides hq={hq} (GQA)", k)
    if window is not None:
        window = integer("window", window, min=1, what="None or an integer >= 1 (tokens a query sees, itself included)")
    scale = 1.0 / math.sqrt(d) if scale is None else real("scale", scale, what="a finite number (or None for 1/sqrt(d))")
    q_pos = batch_positions("q_positions", q_positions, b, tq, device=q.device)  # [b, tq]
    k_pos = batch_positions("k_positions", k_positions, b, tk, device=q.device)  # [b, tk]
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool or key_mask.shape != (b, tk) \
                or key_mask.device != q.device:
            fail("key_mask", f"a bool tensor of shape [{b}, {tk}] on {q.device} (True = attend)", key_mask)
    return q_pos, k_pos, scale


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    encoding: Any = None,
    causal: bool = True,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    impl: str = "eager",
    window: int | None = None,
    table: Any = None,
    chunk: int | None = None,
    temperature: QueryTemperature | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention with an explicit positional encoding and explicit logical positions.

    Args:
        q: `[b, hq, tq, d]` queries.
        k: `[b, hk, tk, d]` keys; GQA when `hq % hk == 0` (each key head serves `hq // hk` query heads).
        v: `[b, hk, tk, dv]` values.
        q_positions: `[tq]` or `[b, tq]` integer logical positions of the queries (cache-aware).
        k_positions: `[tk]` or `[b, tk]` integer logical positions of the keys.
        encoding: None, a `Rope`, a bias scheme or an absolute scheme (see the module docstring).
        causal: hide keys whose logical position is above the query's.
        key_mask: `[b, tk]` bool, True = attend (False for padding and empty cache slots).
        scale: multiplier on `q @ k^T` (default `1 / sqrt(d)`; T5 uses 1.0).
        impl: "eager", "sdpa" or "flex".
        window: sliding window (Mistral, Gemma local layers): a query at p sees keys at positions
            p - window + 1 .. p only (`q_pos - k_pos < window`, transformers' convention); None = no window.
        table: with a `Rope` encoding of a length-independent scaling, a `RopeTable` of it (`rope.table(n)`)
            to read the rows from (no table work per call).
        chunk: chunked attention (Llama 4's RoPE layers): a query at p sees keys whose position lies in the
            same chunk, `floor(p / chunk) == floor(k_pos / chunk)` (with `causal`, those at or before p); None = off.
        temperature: a `posenc.rope.temperature.QueryTemperature`: q is multiplied by `temperature.scale(q_pos)`
            (float32 factors, the product cast back to q's dtype) after the encoding; needs q positions >= 0.
        softcap: Gemma 2's attention soft-capping: the scaled scores become `softcap * tanh(s / softcap)`
            before any bias and the mask; "eager" and "flex" only (sdpa cannot change scores).
        sinks: `[hq]` attention sinks (gpt-oss): one logit per query head joins each row's softmax and its
            probability is dropped (the row's weights sum to less than 1); "eager" only.
    Returns:
        `[b, hq, tq, dv]` in q's dtype; rows with no visible key (and every row when tk = 0) are zeros.
    Raises:
        PosencError: bad ranks or shapes, heads that do not divide, non-integer positions (or, with a
            Rope, negative ones), positions on another device than q, an unknown encoding or impl, a Rope
            or absolute embedding whose width is not d, `impl="flex"` on a torch without it, a chunk that is
            not an integer >= 1, a temperature that is not a QueryTemperature (or negative q positions with
            one), a softcap that is not a number > 0, a softcap with `impl="sdpa"`, sinks that are not a
            float tensor of shape [hq] or with an impl other than "eager".
    """
    choice("impl", impl, ATTENTION_IMPLS)
    q_pos, k_pos, scale = check_inputs(q, k, v, q_positions, k_positions, key_mask, scale, window)  # [b, t]
    chunk, softcap = check_score_options(chunk, temperature, softcap, impl)
    if sinks is not None:
        _check_sinks(sinks, q, impl)
    b, hq, tq, hk, tk = q.shape[0], q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    check_encoding(encoding, q)
    if b == 0 or tq == 0 or tk == 0:  # nothing to attend to (or nobody asking): no kernel, no table
        return q.new_zeros(b, hq, tq, v.shape[-1])
    q, k, bias_scheme = encode_qk(encoding, q, k, q_pos, k_pos, q_positions, k_positions, table=table)
    if temperature is not None:
        q = apply_temperature(temperature, q, q_pos)  # [b, hq, tq, d]
    # Rows with no visible key see everything (finite softmax) and are zeroed after: never NaN.
    safe, seen = visibility(q_pos, k_pos, key_mask, window, causal=causal, chunk=chunk)  # [b, 1, tq, tk], [b, 1, tq, 1]
    bias = None if bias_scheme is None else _bias_4d(bias_scheme, q_positions, k_positions, hq)  # [b or 1, h, tq, tk]

    if impl == "flex":
        _check_flex_backward(q, k, v, bias_scheme)
        out = _flex(q, k, v, q_pos, k_pos, bias_scheme, causal, key_mask, scale, window, chunk, softcap)
    elif impl == "sdpa":
        return sdpa_attention(q, k, v, safe, seen, scale=scale, bias=bias)
    else:
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        groups = hq // hk
        k_rep = k.repeat_interleave(groups, dim=1) if groups > 1 else k  # [b, hq, tk, d]
        v_rep = v.repeat_interleave(groups, dim=1) if groups > 1 else v  # [b, hq, tk, dv]
        scores = (q.to(compute) @ k_rep.to(compute).transpose(-1, -2)) * scale  # [b, hq, tq, tk]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap  # Gemma 2's order: divide, tanh, multiply
        if bias is not None:
            scores = scores + bias.to(compute)
        scores = scores.masked_fill(~safe, float("-inf"))  # [b, hq, tq, tk]
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)  # [b, hq, tq, tk]
        else:  # the sink's logit joins the softmax; its share is dropped
            sink = sinks.to(compute).view(1, hq, 1, 1).expand(b, hq, tq, 1)  # [b, hq, tq, 1]
            probs = torch.softmax(torch.cat((scores, sink), -1), dim=-1)[..., :-1]  # [b, hq, tq, tk]
        out = probs @ v_rep.to(compute)  # [b, hq, tq, dv]
    out = out if seen is None else out * seen  # [b, hq, tq, dv]; rows with nothing to see -> 0
    return out.to(q.dtype)


def check_score_options(chunk: Any, temperature: Any, softcap: Any, impl: str) -> tuple[int | None, float | None]:
    """Check `attention`'s chunk, temperature and softcap (and softcap against impl); return chunk and softcap.

    Raises:
        PosencError: a chunk that is not an integer >= 1, a temperature that is not a `QueryTemperature`,
            a softcap that is not a finite number > 0, a softcap with impl "sdpa".
    """
    if chunk is not None:
        chunk = integer("chunk", chunk, min=1, what="None or an integer >= 1 (positions per attention chunk)")
    if temperature is not None and not isinstance(temperature, QueryTemperature):
        fail("temperature", "None or a posenc.rope.temperature.QueryTemperature", temperature)
    if softcap is not None:
        softcap = real("softcap", softcap, gt=0.0, what="None or a finite number > 0")
        if impl == "sdpa":
            fail("impl", "'eager' or 'flex' with a softcap (scaled_dot_product_attention cannot cap scores)", impl)
    return chunk, softcap


def _check_sinks(sinks: Any, q: torch.Tensor, impl: str) -> None:
    check_float_tensor("sinks", sinks, ndim=(1,))
    if sinks.shape[0] != q.shape[1] or sinks.device != q.device:
        fail("sinks", f"a tensor of shape [hq={q.shape[1]}] on {q.device}", sinks)
    if impl != "eager":
        fail("impl", "'eager' with sinks (posenc adds attention sinks in eager attention only)", impl)
