"""Running the `posenc.models.Decoder`: `forward` over an explicit KV cache, and `new_cache`.

`DecoderForward` is the base class of `Decoder` (`posenc.models.decoder` builds the model: sizes, layers,
loading); its methods read the attributes `Decoder.__init__` sets. The layers it runs are in
`posenc.models.layers` and `posenc.models.blocks`; the cache is `posenc.cache.KVCache`.

`forward(input_ids, position_ids=None, attention_mask=None, cache=None) -> logits`: positions are
logical and explicit; when omitted they count only the tokens the mask keeps, continuing after the
cache's last position, so left padding never shifts them. The cache is an object passed in and updated.

Length-dependent scalings (dynamic NTK, LongRoPE) use, for each row, `seq_len = last position + 1` of
that row alone; transformers' batch maximum is not used because it makes a request depend on its
batch-mates. When a row grows into a different table, the cache's policy decides (cost per switch):
- "recompute" (default): re-run the row's cached tokens under the new table in the same forward, so
  every step equals a full forward over the whole sequence. Cost: a forward over all cached tokens per
  switch (LongRoPE: once, at L0 + 1; dynamic NTK: every step past L0).
- "rerotate": rotate every layer's cached keys to the new table (rotated storage: one 2x2 map per cached
  key and layer; unrotated storage: free, keys are rotated on read). First-layer keys are exact; deeper
  layers keep values and keys computed from hidden states of the old table, so logits differ from a full forward.
- "freeze": keep the table chosen when the row was first filled. Cost: none. Differs from a full forward.
- "refuse": raise PosencError, changing nothing.

    >>> import torch
    >>> from posenc.models import Decoder
    >>> cfg = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
    ...        "intermediate_size": 64}
    >>> model = Decoder.from_hf_config(cfg, seed=0).double()
    >>> cache = model.new_cache(batch_size=2, capacity=8)
    >>> mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0 is left-padded: its positions start at 0 all the same
    >>> model(torch.tensor([[0, 5, 6], [4, 5, 6]]), attention_mask=mask, cache=cache).shape
    torch.Size([2, 3, 50])
    >>> cache.next_positions().tolist()
    [2, 3]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import attention, sdpa_attention, visibility
from ..cache import KVCache, check_model_cache, check_new_positions
from ..errors import assert_values, batch_positions, fail, integer_tensor, rename
from ..rope.rerotate import row_tables
from .layers import Step

__all__ = ["DecoderForward"]


class DecoderForward(nn.Module):
    """The methods that run a built `Decoder`: `new_cache`, `forward` and the helpers `forward` calls.

    Not built on its own: `Decoder.__init__` sets what these methods read (`embed_tokens`, `layers`, `norm`,
    `lm_head`, `encoding`, `kind`, `rope`, `arch`, `attn_impl`, `scale`, `layer_windows`, `vocab_size`,
    `num_kv_heads`, `head_dim`).
    """

    # ---------------------------------------------------------------- cache
    def new_cache(self, batch_size: int, capacity: int | None = None, store: str = "rotated",
                  policy: str = "recompute", *, block_size: int | None = None,
                  kv_dtype: str | None = None) -> KVCache:
        """An empty `KVCache` for this model (its dtype, device, heads and RoPE).

        Args:
            batch_size: rows.
            capacity: slots per row (prompt + generated tokens; a full cache raises PosencError saying
                how to size it), or None to grow on demand (doubling; amortised O(1) per token).
            store: "rotated" or "unrotated" keys. policy: "recompute", "rerotate", "freeze" or "refuse".
            block_size: None (contiguous rows) or slots per block of paged storage (forks share blocks).
            kv_dtype: None (the model's dtype) or a `posenc.cache.quant.formats` format ("int8", "int4", "fp8",
                "bfloat16", ...): a `QuantizedKVCache` (store "unrotated": keys per channel before RoPE).
                Not with a block_size (quantized storage is contiguous).
        """
        if store != "rotated" and self.arch is not None and self.arch.own_ropes:
            fail("store", f"'rotated' (the layers of this {self.arch.family} model rotate their own keys before the "
                 "cache: there are no unrotated keys to store)", store)
        weight = self.embed_tokens.weight
        if kv_dtype is not None:
            from ..cache.quant import QuantizedKVCache

            if block_size is not None:
                fail("block_size", "None with a kv_dtype (quantized storage is contiguous)", block_size)
            return QuantizedKVCache(len(self.layers), batch_size, self.num_kv_heads, self.head_dim, capacity,
                                    kv_dtype=kv_dtype, rope=self.rope, store=store, policy=policy,
                                    dtype=weight.dtype, device=weight.device, absolute=self.kind == "absolute")
        return KVCache(len(self.layers), batch_size, self.num_kv_heads, self.head_dim, capacity, rope=self.rope,
                       store=store, policy=policy, dtype=weight.dtype, device=weight.device,
                       absolute=self.kind == "absolute", block_size=block_size)

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Logits for new tokens, appending them to `cache` (a temporary cache when None: a full forward).

        Args:
            input_ids: `[b, t]` token ids.
            position_ids: `[t]` or `[b, t]` logical positions (default: count the kept tokens after the cache).
            attention_mask: `[b, t]`, or `[b, cached + t]` as transformers passes it (only the last t columns
                are used; the earlier ones must count each row's cached tokens); 0/False = padding.
            cache: a `KVCache` from `new_cache`, updated in place.
        Returns:
            `[b, t, vocab]` logits; rows at padding are finite but meaningless.
        Raises:
            PosencError: bad ids, masks or positions (not increasing, not past the cache), a full cache,
                a cache of another shape, policy "refuse" when a row's frequencies change.
        """
        ids, mask = self._check_inputs(input_ids, attention_mask, cache)
        b, t = ids.shape
        if cache is not None and (not isinstance(cache, KVCache) or cache.batch_size != b
                                  or cache.num_layers != len(self.layers) or cache.rope != self.rope
                                  or (cache.num_kv_heads, cache.head_dim) != (self.num_kv_heads, self.head_dim)):
            fail("cache", f"a KVCache from this model's new_cache with batch_size={b}", cache)
        if cache is not None:
            weight = self.embed_tokens.weight
            check_model_cache(cache, weight.dtype, weight.device, len(self.layers), self.num_kv_heads, self.head_dim)
        start = torch.zeros(b, dtype=torch.long, device=ids.device) if cache is None else cache.next_positions()
        if position_ids is None:
            positions = start[:, None] + mask.long().cumsum(dim=1) - 1  # [b, t]
        else:
            positions = batch_positions("position_ids", position_ids, b, t,  # [b, t]; negatives fail below
                                        device=start.device)
        positions = positions.masked_fill(~mask, 0)  # padding: a placeholder, never cached or counted
        names = ("input_ids" if position_ids is None else "position_ids", "attention_mask")
        if cache is None:  # a full forward: the positions are checked as for an empty cache, no cache built
            check_new_positions(positions, mask, start - 1, names=names)
        else:
            check_new_positions(positions, mask, start - 1, None if cache.growable else cache.capacity - cache.lengths,
                                names=names, capacity=cache.capacity, lengths=cache.lengths)
        seq_lens = torch.maximum(start, (positions + 1).masked_fill(~mask, 0).max(dim=1).values)  # [b], per row
        if cache is None:
            return self._run(ids, positions, mask, None, seq_lens)
        with cache.transaction():  # a refused call (a layer's write, an error in a layer) leaves the cache as it was
            if self.rope is not None and self.rope.scaling.depends_on_length:
                redo = cache.retable(seq_lens)
                if bool(redo.any()):
                    ids, positions, mask = self._prepend_cached(cache, redo, ids, positions, mask)
                    cache.retable(seq_lens)  # the cleared rows adopt the new table
            else:
                cache.retable(seq_lens)  # records the lengths; no host sync
            return self._run(ids, positions, mask, cache)[:, -t:]

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache | None,
             seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Embed, run the layers, project. `cache=None`: a full forward whose keys are its own tokens
        (padding hidden), with RoPE tables at `seq_lens [b]`; otherwise append to `cache` and read it."""
        h = self.embed_tokens(ids)  # [b, t, hidden]
        if self.arch is not None and self.arch.embed_scale != 1.0:
            h = h * self.arch.embed_scale  # Gemma's sqrt(hidden), Granite's embedding_multiplier
        if self.kind == "absolute":
            h = h + self.encoding.embedding(positions).to(h.dtype)  # [b, t, hidden]
        cos = sin = key_tables = slots = index = width = None
        if cache is None:
            key_positions, key_mask = positions, mask  # [b, t]
            if self.rope is not None:
                cos, sin = row_tables(self.rope, positions, seq_lens)  # [b, t, r/2]
        else:
            slots = cache.reserve(positions, mask, ids)  # [b, t]
            width = cache.read_width  # a host-side bound of the longest row: no sync
            key_positions = cache.positions[:, :width]  # [b, w]
            key_mask = key_positions >= 0
            index = cache.write_index(slots)
            if self.rope is not None:
                cos, sin = cache.tables(positions)  # [b, t, r/2], each row at its table_len
                if cache.store == "unrotated":
                    key_tables = cache.tables(key_positions)  # [b, w, r/2], shared by every layer
        step = Step(attend=self._attend(positions, key_positions, key_mask), windows=self.layer_windows,
                    pairing=self.rope.pairing if self.rope is not None else None, cos=cos, sin=sin,
                    key_tables=key_tables, slots=slots, index=index, width=width, positions=positions,
                    layer_tables=self.arch.layer_tables(positions) if self.arch and self.arch.own_ropes else None)
        for i, layer in enumerate(self.layers):
            h = layer(h, i, step, cache)  # [b, t, hidden]
        logits = self.lm_head(self.norm(h))  # [b, t, vocab]
        return logits if self.arch is None else self.arch.final_logits(logits)

    def _attend(self, positions: torch.Tensor, key_positions: torch.Tensor, key_mask: torch.Tensor) -> Any:
        """This forward's attention, `attend(q, k, v, window, chunk=None)`: masks from logical positions, built once.

        "sdpa" without a bias scheme builds one boolean mask per distinct (window, chunk) and shares it across
        layers; "eager", "flex" and bias schemes go through `posenc.attention.attention` per layer.
        """
        impl, scale = self.attn_impl, self.scale
        softcap = self.arch.attn_softcap if self.arch is not None else None
        scheme = self.encoding if self.kind == "bias" else None
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

        def attend(q, k, v, window, chunk=None, sinks=None):  # sinks: refused with sdpa by the attn_impl setter
            if (window, chunk) not in masks:
                masks[window, chunk] = visibility(positions, key_positions, key_mask, window, chunk=chunk)  # [b, 1, t, w]
            return sdpa_attention(q, k, v, *masks[window, chunk], scale=scale)  # [b, hq, t, d]
        return attend

    def _prepend_cached(self, cache: KVCache, redo: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """"recompute": put the cached tokens of `redo` rows in front of the new ones and clear those rows."""
        lengths = cache.lengths.masked_fill(~redo, 0)  # [b]
        slot = torch.arange(cache.capacity, device=ids.device)[None, :]  # [1, cap]
        used = slot < lengths[:, None]  # [b, cap]
        if bool((cache.tokens[used] < 0).any()):
            fail("cache", "token ids in every cached slot (policy 'recompute' re-runs them; write through the "
                 "model or use policy 'rerotate')", "slots without token ids")
        c = int(lengths.max())
        pad = c - lengths[:, None]  # [b, 1]: left padding in front of each row's re-run tokens
        col = torch.arange(c, device=ids.device)[None, :]  # [1, c]
        src = (col - pad).clamp(min=0)  # [b, c] slot read by each prepended column
        keep = col >= pad  # [b, c]
        old_ids = cache.tokens.gather(1, src).masked_fill(~keep, 0)
        old_pos = cache.positions.gather(1, src).masked_fill(~keep, 0)
        cache.clear(redo)
        return torch.cat((old_ids, ids), 1), torch.cat((old_pos, positions), 1), torch.cat((keep, mask), 1)

    # ---------------------------------------------------------------- checks
    def _check_inputs(self, input_ids: Any, attention_mask: Any, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        what = "an integer tensor of shape [b, t] with t >= 1"
        input_ids = integer_tensor("input_ids", input_ids, ndim=(2,), what=what)  # int64: uint16/32/64 do not compare
        if input_ids.shape[1] == 0:
            fail("input_ids", what, input_ids)
        if input_ids.numel():  # on the device: no host sync
            assert_values("input_ids", ((input_ids >= 0) & (input_ids < self.vocab_size)).all(),
                          f"token ids in [0, vocab_size={self.vocab_size})",
                          lambda: f"ids in [{int(input_ids.min())}, {int(input_ids.max())}]")
        b, t = input_ids.shape
        if attention_mask is None:
            return input_ids.long(), torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        what = f"a 0/1 tensor of shape [{b}, {t}] or [{b}, cached + {t}]"
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2 or attention_mask.shape[0] != b \
                or attention_mask.shape[1] < t or attention_mask.dtype.is_complex:
            fail("attention_mask", what, attention_mask)
        assert_values("attention_mask", ((attention_mask == 0) | (attention_mask == 1)).all(), what,
                      lambda: attention_mask)  # 0/1 of any real dtype, checked on the device
        mask = attention_mask.bool()
        if mask.shape[1] > t:
            past = mask[:, :-t].sum(dim=1)  # [b]
            held = cache.lengths if isinstance(cache, KVCache) else torch.zeros_like(past)
            if held.shape != past.shape:  # named before comparing: rows that differ would broadcast
                fail("cache", f"a KVCache from this model's new_cache with batch_size={b}", cache)
            held = held.to(past.device)
            assert_values("attention_mask", (past == held).all(),  # on the device: no host sync, traceable
                          f"past columns counting each row's cached tokens (or pass only the last {t} columns)",
                          explain=lambda: (f"past columns counting each row's cached tokens {held.tolist()} "
                                           f"(or pass only the last {t} columns)", past.tolist()))
        return input_ids.long(), mask[:, -t:]
