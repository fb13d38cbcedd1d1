"""A KVCache whose keys and values are stored quantized (or cast) and decoded on read.

`QuantizedKVCache(..., kv_dtype="int4", store="unrotated")` keeps the same logical positions, policies and
editing as `KVCache`; only the per-layer stores differ (`posenc.cache.quant.store.QuantStore`):
- store "unrotated": keys quantized per channel, in blocks of `group` tokens, **before** RoPE (KVQuant);
  rotated at read. `move`, `keep_recent(shift=True)`, `rollback`, `reorder` and a table switch only relabel
  or move codes: nothing is re-quantized, so no error accumulates.
- store "rotated": keys quantized per token after RoPE. Re-rotation (`move`, a shift, policy "rerotate")
  must decode, rotate and re-encode, adding up to one more quantization error per re-rotation (what
  llama.cpp's context shift does on a quantized K cache).
Values are quantized per token in both. `kv_dtype` "float32" / "bfloat16" / "float16" store a plain cast.

    >>> import torch, posenc
    >>> cache = QuantizedKVCache(1, 1, 1, 4, capacity=8, rope=posenc.Rope(head_dim=4), kv_dtype="int8")
    >>> cache.k[0].shape, cache.key_axis
    ((1, 1, 8, 4), 'token')
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..kvcache import KVCache
from ...errors import Raw, choice, fail, integer
from .formats import ALIASES, FORMATS, bytes_per_vector, kv_format
from .store import DEFAULT_GROUP, QuantStore

__all__ = ["QuantizedKVCache", "cache_bytes_per_token", "bytes_per_number", "kv_label"]


def cache_bytes_per_token(kv_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, *,
                          store: str = "rotated", value_dim: int | None = None, group: int = DEFAULT_GROUP) -> float:
    """Bytes one token costs in a `QuantizedKVCache` (codes and statistics of keys and values, all layers;
    per-channel keys add their 4-byte block id per layer). Raises PosencError for an unknown kv_dtype."""
    fmt = kv_format(kv_dtype)
    channel = store == "unrotated" and fmt.kind != "cast"
    key = bytes_per_vector(fmt, head_dim, "channel" if channel else "token", group) * num_kv_heads
    value = bytes_per_vector(fmt, head_dim if value_dim is None else value_dim, "token") * num_kv_heads
    return num_layers * (key + value + (4 if channel else 0))


def kv_label(kv_dtype: Any, default_keys: str, arg: str = "--kv-dtype") -> str:
    """`"FORMAT[:pre|:post]"` in canonical form (`"bf16"` -> `"bfloat16:post"` with default_keys "post").

    Raises:
        PosencError: naming `arg`: an unknown format, keys other than pre / post.
    """
    name, _, keys = kv_dtype.partition(":") if isinstance(kv_dtype, str) else (kv_dtype, "", "")
    fmt = kv_format(name, arg=arg)
    choice(arg, keys or default_keys, ("pre", "post"))
    return f"{fmt.name}:{keys or default_keys}"


def bytes_per_number(label: str, num_kv_heads: int, head_dim: int, arg: str = "--kv-dtype") -> float:
    """Bytes per cached key or value number of a `QuantizedKVCache` "FORMAT:pre|post" (`cache_bytes_per_token`
    over 2 x heads x head_dim; "pre" stores keys unrotated, per channel). PosencError naming `arg` for a bad
    label or int4 with an odd head_dim."""
    if not isinstance(label, str) or ":" not in label:
        fail(arg, f"FORMAT:pre or FORMAT:post with FORMAT in {tuple(FORMATS) + tuple(ALIASES)}", label)
    label = kv_label(label, "post", arg)
    fmt, store = kv_format(label.split(":")[0]), "unrotated" if label.endswith(":pre") else "rotated"
    if fmt.bits == 4 and head_dim % 2:
        fail(arg, "an even head_dim for int4 (two channels per byte)", Raw(f"head_dim {head_dim}"))
    return cache_bytes_per_token(fmt.name, 1, num_kv_heads, head_dim, store=store) / (2 * num_kv_heads * head_dim)


class QuantizedKVCache(KVCache):
    """`KVCache` whose per-layer stores are `posenc.cache.quant.store.QuantStore`s (codes, decoded on read).

    Everything else (positions, policies, edits, `reserve` / `write` / `read` / `update`) is `KVCache`'s own,
    over the `KVStore` protocol. Host syncs: none on the append path of a fixed-capacity cache (`reserve`,
    `write`, `update`) for every kv_dtype and store (value range and slot order are checked on the device);
    edits of a per-channel key store (store "unrotated" with int8 / int4 / fp8) reclaim its statistics pool
    with one.

    Args:
        As `KVCache` (dtype: the model's dtype, which `read` returns and the residual keeps; no block_size),
        plus kv_dtype: "float32", "bfloat16", "float16", "int8", "int4" or "fp8" (short names fp32, bf16,
        fp16, e4m3); group: tokens per per-channel key block (store "unrotated" with a scaled format).
    Attributes:
        k, v: per layer the key part (`ChannelStore` or `TokenStore`) and the value part (`TokenStore`) of
        each store (logical `.shape [b, hk, capacity, d]`, `.read(width)`); key_axis: "channel" or "token";
        format: the `KVFormat`; group.
    Raises:
        PosencError: as `KVCache`; an unknown kv_dtype; int4 with an odd head_dim or value_dim; group < 1.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int | None, *,
                 kv_dtype: str = "int8", group: int = DEFAULT_GROUP, rope: Any = None, store: str = "rotated",
                 policy: str = "recompute", value_dim: int | None = None, dtype: torch.dtype = torch.float32,
                 device: Any = None, absolute: bool = False) -> None:
        self.format = kv_format(kv_dtype)
        self.group = integer("group", group, min=1)
        vdim = head_dim if value_dim is None else value_dim
        if self.format.bits == 4:
            for arg, dim in (("head_dim", head_dim), ("value_dim", vdim)):
                if isinstance(dim, int) and dim % 2:
                    fail(arg, "an even number of channels for kv_dtype int4 (two channels per byte)", dim)
        self.key_axis = "channel" if store == "unrotated" and self.format.kind != "cast" else "token"
        make = functools.partial(QuantStore, fmt=self.format, group=self.group, key_axis=self.key_axis)
        super().__init__(num_layers, batch_size, num_kv_heads, head_dim, capacity, rope=rope, store=store,
                         policy=policy, value_dim=value_dim, dtype=dtype, device=device, absolute=absolute,
                         make_store=make)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", kv_dtype={self.format.name!r}, key_axis={self.key_axis!r})"

    @property
    def k(self) -> list[Any]:
        """Per layer the key part of the store (`ChannelStore` or `TokenStore`)."""
        return [store.keys for store in self.stores]

    @property
    def v(self) -> list[Any]:
        """Per layer the value part of the store (`TokenStore`)."""
        return [store.values for store in self.stores]

    @property
    def nbytes(self) -> int:
        """Bytes the stored keys and values take now (codes, statistics of blocks in use, block ids; not the
        residual or the scratch slot)."""
        return sum(store.nbytes for store in self.stores)
