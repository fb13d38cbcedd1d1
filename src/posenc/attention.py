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

from .errors import Raw, assert_values, batch_positions, check_float_tensor, choice, fail, integer, real
from .rope import route
from .rope.rerotate import row_tables
from .rope.spec import Rope
from .rope.temperature import QueryTemperature

__all__ = ["attention", "IMPLS", "encoding_kind", "check_inputs", "encode_qk", "flex_score_mod",
           "visibility", "sdpa_attention", "check_score_options", "apply_temperature"]

IMPLS = ("eager", "sdpa", "flex")


def encoding_kind(encoding: Any) -> str:
    """Classify an encoding: "none", "rope", "bias" or "absolute" (raises PosencError otherwise)."""
    if encoding is None:
        return "none"
    if isinstance(encoding, Rope):
        return "rope"
    if callable(getattr(encoding, "bias", None)) and callable(getattr(encoding, "score_mod", None)):
        return "bias"
    if callable(getattr(encoding, "embedding", None)):
        return "absolute"
    fail("encoding", "None, a posenc.Rope, a bias scheme (ALiBi, T5RelativeBias) or an absolute scheme", encoding)


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
    choice("impl", impl, IMPLS)
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


def apply_temperature(temperature: QueryTemperature, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """`q [b, hq, t, d]` times `temperature.scale(q_pos [b, t])` (float32 factors; the product in q's dtype).

    Raises:
        PosencError: negative positions.
    """
    assert_values("q_positions", (q_pos >= 0).all(), "positions >= 0 (a query temperature grows with the position)",
                  lambda: Raw(f"min {int(q_pos.min())}"))
    factor = temperature.scale(q_pos).to(q.device)  # [b, t] float32, as Llama 4 and Ministral 3 compute it
    return (q * factor[:, None, :, None]).to(q.dtype)  # [b, hq, t, d]


def check_encoding(encoding: Any, q: torch.Tensor) -> str:
    """Check that `encoding` fits q (a bias scheme's heads, a Rope's width); return its kind."""
    hq, d = q.shape[1], q.shape[-1]
    kind = encoding_kind(encoding)
    if kind == "bias" and getattr(encoding, "heads", hq) != hq:
        fail("encoding", f"a bias scheme covering hq={hq} heads", Raw(f"one covering {encoding.heads}"))
    if kind == "rope" and encoding.head_dim != d:
        fail("encoding", f"a Rope with head_dim={d} (the width of q and k)", encoding)
    return kind


def encode_qk(encoding: Any, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              q_positions: torch.Tensor, k_positions: torch.Tensor, seq_len: int | None = None,
              table: Any = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Apply an encoding's effect on q and k; return `(q, k, bias scheme or None)`.

    A Rope rotates q and k with ONE table per row, that of the forward's length: `seq_len` if given (the
    global length under context parallelism), else `max(q and k positions of the row) + 1`, as a full
    forward in transformers. An absolute scheme adds its embedding; a bias scheme is returned for the scores.

    Args:
        q_pos, k_pos: int64 `[b, tq]`, `[b, tk]` positions (from `check_inputs`).
        q_positions, k_positions: the positions as given (`[t]` or `[b, t]`) for absolute tables.
    Raises:
        PosencError: an unknown encoding, a bias scheme for another head count, a bad width, negative
            positions under a Rope.
    """
    kind = check_encoding(encoding, q)
    if kind == "rope":
        q, k = _rotate(encoding, q, k, q_pos, k_pos, seq_len, table)
    elif kind == "absolute":
        d = q.shape[-1]
        q = q + _absolute(encoding, q_positions, d).unsqueeze(-3).to(q.dtype)  # [b?, 1, tq, d]
        k = k + _absolute(encoding, k_positions, d).unsqueeze(-3).to(k.dtype)  # [b?, 1, tk, d]
    return q, k, encoding if kind == "bias" else None


def _rotate(rope: Rope, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            seq_len: int | None = None, table: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated with one table per row, that of length `seq_len` or `max(q and k positions) + 1`.

    Through the router (`rope.route`), like every rotation; `table`: a `RopeTable` of `rope` to read rows from.
    """
    for arg, pos in (("q_positions", q_pos), ("k_positions", k_pos)):  # on the device: no host sync
        assert_values(arg, (pos >= 0).all(), "positions >= 0 (a Rope rotates by the position)",
                      lambda pos=pos: Raw(f"min {int(pos.min())}"))
    if not rope.scaling.depends_on_length:  # one table whatever the length: the fast path (kernels)
        return rope.rotate(q, q_pos, table=table), rope.rotate(k, k_pos, table=table)
    if seq_len is not None:
        lengths = torch.full((q_pos.shape[0],), int(seq_len), dtype=torch.long, device=q_pos.device)  # [b]
    else:
        lengths = torch.maximum(q_pos.amax(dim=1), k_pos.amax(dim=1)) + 1  # [b]: the forward's length per row
    cos_q, sin_q = row_tables(rope, q_pos, lengths)  # [b, tq, r/2]
    cos_k, sin_k = row_tables(rope, k_pos, lengths)  # [b, tk, r/2]
    return (route.rotate(q, None, cos_q, sin_q, None, rope.pairing)[0],
            route.rotate(k, None, cos_k, sin_k, None, rope.pairing)[0])


def _absolute(encoding: Any, positions: torch.Tensor, d: int) -> torch.Tensor:
    emb = encoding.embedding(positions)  # [t, d] or [b, t, d]
    if emb.shape[-1] != d:
        fail("encoding", f"an absolute embedding of width d={d}", emb)
    return emb


def _bias_4d(scheme: Any, q_positions: torch.Tensor, k_positions: torch.Tensor, heads: int) -> torch.Tensor:
    bias = scheme.bias(q_positions, k_positions)  # [h, tq, tk] or [b, h, tq, tk]
    if bias.shape[-3] != heads:
        fail("encoding", f"a bias scheme for hq={heads} heads", bias)
    return bias if bias.ndim == 4 else bias.unsqueeze(0)  # [b or 1, h, tq, tk]


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
