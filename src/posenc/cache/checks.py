"""Checks of new tokens against what a row already holds, with no host sync on the accepted path.

The cache and the decoder's no-cache forward share `check_new_positions`; each passes its own argument
names, so a message names what the caller wrote (no renaming afterwards). A condition is computed on
the tensors' device and handed to `errors.assert_values`: on the CPU in eager mode a failure raises
`PosencError` at once with a message that names the row and value (read only after the failure); on an
accelerator or under `torch.compile` it becomes `torch._assert_async`, so the accepted path never waits.

    >>> import torch
    >>> last = torch.tensor([2])                     # the row holds positions up to 2
    >>> check_new_positions(torch.tensor([[3, 5]]), None, last).tolist()
    [[True, True]]
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import Raw, assert_values, check_float_tensor, fail, integer, integer_tensor, positions as check_positions
from ..rope.spec import Rope

__all__ = ["check_new_positions", "check_write", "check_layout", "check_tokens", "check_model_cache"]


def check_new_positions(positions: Any, mask: Any, last: torch.Tensor, free: torch.Tensor | None = None, *,
                        names: tuple[str, str] = ("positions", "mask"), capacity: int | None = None,
                        lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Validate new tokens for rows that end at `last`; change nothing; return the bool mask `[b, t]`.

    Unmasked positions must be >= 0, strictly increasing along the row and past `last`; with `free`, at
    most `free[row]` unmasked tokens per row. Masked tokens (padding) are ignored.

    Args:
        positions: `[b, t]` integer logical positions.
        mask: `[b, t]` bool, False for padding, or None (no padding).
        last: `[b]` int64 last held position per row (-1 for an empty row).
        free: `[b]` free slots per row, or None (unbounded); `capacity` and `lengths` feed its message.
        names: the caller's names for (positions, mask).
    Returns:
        `[b, t]` bool mask.
    Raises:
        PosencError: naming `names[0]` or `names[1]`.
    """
    p_arg, m_arg = names
    b = last.shape[0]
    positions = check_positions(p_arg, positions, shapes=[(b, "t")], allow_negative=True,
                                device=last.device).long()  # [b, t]
    if mask is None:
        mask = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != positions.shape:
        fail(m_arg, f"a bool tensor of shape {tuple(positions.shape)}", mask)
    big = torch.iinfo(torch.long).max
    real = positions.masked_fill(~mask, big)  # [b, t]; padding never constrains anything
    assert_values(p_arg, (real >= 0).all(), "positions >= 0 for unmasked tokens", lambda: Raw(f"min {int(real.min())}"))
    prev = torch.cat((last[:, None], real), dim=1)  # [b, 1 + t]
    prev = torch.cummax(prev.masked_fill(prev == big, -1), dim=1).values[:, :-1]  # last real position before
    bad = mask & (real <= prev)  # [b, t]

    def order() -> tuple[str, Any]:
        row, col = (int(i) for i in bad.nonzero()[0])
        before = int(prev[row, col])
        if bool(mask[row, :col].any()):  # the clash is inside this call, not with the cache
            what = f"row {row} strictly increasing (the token before it is at {before})"
        else:
            what = f"row {row} past its last cached position {before}"
        return f"{what}; each position holds one token", int(positions[row, col])

    assert_values(p_arg, ~bad.any(), "positions strictly increasing and past each row's last cached one", explain=order)
    if free is not None:
        count = mask.sum(dim=1)  # [b]

        def room() -> tuple[str, Any]:
            row = int((count > free).nonzero()[0])
            need = int((lengths + count).max())
            return (f"at most {int(free[row])} new tokens in row {row} (capacity {capacity}, "
                    f"{int(lengths[row])} used); size the cache for prompt + generated tokens, e.g. "
                    f"new_cache(batch_size, capacity={need}) or more, or capacity=None to grow on demand",
                    int(count[row]))

        assert_values(p_arg, (count <= free).all(), "new tokens that fit in each row's free slots", explain=room)
    return mask


def check_write(k: Any, v: Any, slots: Any, sizes: tuple[int, int, int, int], lengths: torch.Tensor) -> None:
    """Check one layer's write: `k [b, hk, t, d]`, `v [b, hk, t, dv]` on the cache's device, `slots [b, t]` reserved.

    Args:
        sizes: the cache's `(b, hk, d, dv)`. lengths: `[b]` filled slots per row (slots must be -1 or below).
    Raises:
        PosencError: naming `k`, `v` or `slots` (shapes on the host; slot values on the device, no host sync).
    """
    b, hk, d, dv = sizes
    slots = integer_tensor("slots", slots, ndim=(2,), what=f"an integer tensor [b={b}, t] from reserve")
    t, device = slots.shape[1], lengths.device
    for arg, x, width in (("k", k, d), ("v", v, dv)):
        check_float_tensor(arg, x, ndim=(4,))
        if tuple(x.shape) != (b, hk, t, width) or x.device != device:
            fail(arg, f"shape [{b}, {hk}, {t}, {width}] on {device} (rows, heads, slots' tokens, channels)", x)
    what = "[b={}, t] slots from reserve (-1, or below each row's length {})"
    if slots.shape[0] != b:
        fail("slots", what.format(b, "lengths"), slots)
    ok = ((slots >= -1) & (slots < lengths[:, None])).all()
    assert_values("slots", ok, what.format(b, "lengths"), explain=lambda: (what.format(b, lengths.tolist()), slots))


def check_layout(head_dim: int, block_size: Any, rope: Any, dtype: Any, make_store: Any) -> int | None:
    """Check a `KVCache`'s block_size (None or >= 1), rope (None or a `posenc.Rope` of `head_dim`), dtype
    (floating point) and make_store (None with a block_size); return block_size as an int or None.

    Raises:
        PosencError: naming the argument.
    """
    if block_size is not None:
        block_size = integer("block_size", block_size, min=1, what="None or a positive integer")
    if rope is not None and (not isinstance(rope, Rope) or rope.head_dim != head_dim):
        fail("rope", f"None or a posenc.Rope with head_dim={head_dim}", rope)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        fail("dtype", "a floating-point torch.dtype", dtype)
    if block_size is not None and make_store is not None:
        fail("make_store", "None with a block_size (paged storage makes its own stores)", make_store)
    return block_size


def check_tokens(tokens: Any, shape: torch.Size) -> None:
    """Refuse token ids that are not None or an integer (not bool) tensor of `shape` (naming `tokens`)."""
    if tokens is not None and (not isinstance(tokens, torch.Tensor) or tokens.shape != shape
                               or tokens.dtype.is_floating_point or tokens.dtype == torch.bool):
        fail("tokens", f"None or an integer tensor of shape {tuple(shape)}", tokens)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_model_cache(cache: Any, dtype: torch.dtype, device: Any, num_layers: int, num_kv_heads: int,
                      head_dim: int, arg: str = "cache") -> None:
    """Refuse a cache that does not fit the model about to write to it, before anything is written.

    Args:
        cache: the `KVCache` a model's forward was given.
        dtype, device: the model's compute dtype and device (what the cache's reads must return, where).
        num_layers, num_kv_heads, head_dim: the model's layers, key/value heads and channels per head.
        arg: the caller's name for the cache.
    Raises:
        PosencError: naming `arg`, saying what the model needs and what the cache holds.
    """
    from .kvcache import KVCache

    if not isinstance(cache, KVCache):
        fail(arg, "a posenc.cache.KVCache (e.g. from the model's new_cache)", cache)
    want = dict(dtype=dtype, device=torch.device(device), layers=num_layers, kv_heads=num_kv_heads,
                head_dim=head_dim)
    have = dict(dtype=cache.dtype, device=cache.device, layers=cache.num_layers, kv_heads=cache.num_kv_heads,
                head_dim=cache.head_dim)
    bad = [name for name in want if (not _same_device(want[name], have[name]) if name == "device"
                                     else want[name] != have[name])]
    if bad:
        fail(arg, "a cache built for this model (" + ", ".join(f"{n}={want[n]}" for n in bad) + "; the model's "
             "new_cache makes one)", Raw("a cache with " + ", ".join(f"{n}={have[n]}" for n in bad)))
