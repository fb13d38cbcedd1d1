"""What the decoder's forward runs on: checked token ids and masks, and the cached tokens that policy
"recompute" runs again in front of the new ones.

    >>> import torch
    >>> ids, mask = checked_inputs(torch.tensor([[3, 4]]), torch.tensor([[0, 1]]), None, vocab_size=8)
    >>> ids.tolist(), mask.tolist()
    ([[3, 4]], [[False, True]])
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import KVCache
from ..errors import assert_values, fail, integer_tensor

__all__ = ["checked_inputs", "prepend_cached"]


def checked_inputs(input_ids: Any, attention_mask: Any, cache: Any, *, vocab_size: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """`(ids [b, t] int64, mask [b, t] bool)` of a forward's inputs; a `[b, cached + t]` mask keeps its last t
    columns once its earlier ones count each row's cached tokens.

    Raises:
        PosencError: ids that are not `[b, t]` integers in `[0, vocab_size)`, a mask that is not 0/1 of shape
            `[b, t]` or `[b, cached + t]`, past columns that do not count the cache's rows, a cache of another batch.
    """
    what = "an integer tensor of shape [b, t] with t >= 1"
    input_ids = integer_tensor("input_ids", input_ids, ndim=(2,), what=what)  # int64: uint16/32/64 do not compare
    if input_ids.shape[1] == 0:
        fail("input_ids", what, input_ids)
    if input_ids.numel():  # on the device: no host sync
        assert_values("input_ids", ((input_ids >= 0) & (input_ids < vocab_size)).all(),
                      f"token ids in [0, vocab_size={vocab_size})",
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


def prepend_cached(cache: KVCache, redo: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Policy "recompute": the cached tokens of the `redo [b]` rows put in front of the new ones (left-padded to
    one width), and those rows cleared; returns `(ids, positions, mask)` `[b, c + t]`.

    Raises:
        PosencError: a cached slot of a redo row without its token id (written around the model), changing nothing.
    """
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
