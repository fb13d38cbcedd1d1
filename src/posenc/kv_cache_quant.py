"""A KVCache whose keys and values are stored quantized (or cast) and decoded on read.

`QuantizedKVCache(..., kv_dtype="int4", store="unrotated")` keeps the same logical positions, policies and
editing as `KVCache`; only the buffers differ (`posenc.kv_store`):
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

from typing import Any

import torch

from .cache import INITIAL_CAPACITY, KVCache
from .errors import Raw, choice, fail, integer
from .kv_quant import ALIASES, FORMATS, bytes_per_vector, kv_format
from .kv_store import DEFAULT_GROUP, ChannelStore, TokenStore
from .rope import route
from .rope.apply import apply_rope
from .rope.rerotate import rerotation_tables, stored_pairing

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
    """`KVCache` with quantized storage.

    Args:
        As `KVCache` (dtype: the model's dtype, which `read` returns and the residual keeps), plus
        kv_dtype: "float32", "bfloat16", "float16", "int8", "int4" or "fp8" (short names fp32, bf16, fp16, e4m3).
        group: tokens per per-channel key block (store "unrotated" with a scaled format).
    Attributes:
        k, v: per layer a `TokenStore` / `ChannelStore` (logical `.shape [b, hk, capacity, d]`); key_axis:
        "channel" or "token"; format: the `KVFormat`.
    Raises:
        PosencError: as `KVCache`; an unknown kv_dtype; int4 with an odd head_dim or value_dim; group < 1.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int | None, *,
                 kv_dtype: str = "int8", group: int = DEFAULT_GROUP, rope: Any = None, store: str = "rotated",
                 policy: str = "recompute", value_dim: int | None = None, dtype: torch.dtype = torch.float32,
                 device: Any = None, absolute: bool = False) -> None:
        self.format = kv_format(kv_dtype)
        self.group = integer("group", group, min=1)
        cap = None if capacity is None else integer("capacity", capacity, min=1)
        vdim = head_dim if value_dim is None else value_dim
        if self.format.bits == 4:
            for arg, dim in (("head_dim", head_dim), ("value_dim", vdim)):
                if isinstance(dim, int) and dim % 2:
                    fail(arg, "an even number of channels for kv_dtype int4 (two channels per byte)", dim)
        super().__init__(num_layers, batch_size, num_kv_heads, head_dim, 1, rope=rope, store=store, policy=policy,
                         value_dim=value_dim, dtype=dtype, device=device, absolute=absolute)  # checks; 1-slot buffers
        self.growable = cap is None
        self.key_axis = "channel" if store == "unrotated" and self.format.kind != "cast" else "token"
        self.dtype = dtype
        cap = INITIAL_CAPACITY if cap is None else cap
        (b, hk, _, d), dv, device = self.k[0].shape, self.v[0].shape[3], self.positions.device
        if self.key_axis == "channel":
            self.k = [ChannelStore(self.format, (b, hk, cap, d), dtype, device, self.group) for _ in self.k]
        else:
            self.k = [TokenStore(self.format, (b, hk, cap, d), dtype, device) for _ in self.k]
        self.v = [TokenStore(self.format, (b, hk, cap, dv), dtype, device) for _ in self.v]
        self.positions = torch.full((b, cap), -1, dtype=torch.long, device=device)
        self.tokens = torch.full((b, cap), -1, dtype=torch.long, device=device)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", kv_dtype={self.format.name!r}, key_axis={self.key_axis!r})"

    @property
    def nbytes(self) -> int:
        """Bytes the stored keys and values take now (codes, statistics, block ids; not the residual)."""
        return sum(s.nbytes for s in self.k + self.v)

    # ---------------------------------------------------------------- storage
    def grow(self, capacity: int) -> None:
        capacity = integer("capacity", capacity, min=self.capacity,
                           what=f"an integer >= the current capacity {self.capacity}")
        extra = capacity - self.capacity
        if extra:
            for store in self.k + self.v:
                store.grow(capacity)
            pad = torch.nn.functional.pad
            self.positions = pad(self.positions, (0, extra), value=-1)  # [b, capacity]
            self.tokens = pad(self.tokens, (0, extra), value=-1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
              index: tuple[torch.Tensor, ...] | None = None, *, rotated: bool = False) -> None:
        """As `KVCache.write`; everything is checked (shapes, slots, values the format can hold) before a
        code is written, so a refused call leaves the cache as it was."""
        layer = self._layer(layer)
        self._check_write(k, v, slots, values=index is None)
        if rotated and not self.rotates_at_write:
            fail("rotated", "False for a cache that stores keys unrotated (or has no rope)", rotated)
        if self.rotates_at_write and not rotated:
            if cos is None or sin is None:
                cos, sin = self.tables(self.positions.gather(1, slots.clamp(min=0)))
            k = route.rotate(k, None, cos, sin, None, self.rope.pairing)[0]  # [b, hk, t, d]
        rows, cols, dest = self.write_index(slots) if index is None else index
        self.k[layer].check(k, "k")
        self.v[layer].check(v, "v")
        if self.key_axis == "channel":
            self.k[layer].check_slots(rows, dest)
        self.k[layer].write(k, rows, cols, dest, "k")
        self.v[layer].write(v, rows, cols, dest, "v")

    def read(self, layer: int, key_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As `KVCache.read`: decoded keys (rotated at their positions) and values, in the cache's dtype."""
        layer = self._layer(layer)
        w = self.width if width is None else width
        k, v = self.k[layer].read(w), self.v[layer].read(w)  # [b, hk, w, d]
        if self.store == "unrotated" and self.rope is not None:
            cos, sin = key_tables if key_tables is not None else self.tables(self.positions[:, :w])
            k = route.rotate(k, None, cos, sin, None, self.rope.pairing)[0]  # [b, hk, w, d]
        return k, v

    def _rerotate(self, rows: torch.Tensor, new_positions: torch.Tensor, new_lens: torch.Tensor) -> None:
        """Rotated storage: decode, rotate from the old to the new positions/table, re-encode (re-quantizes)."""
        w = self.width
        old_p, new_p = self.positions[rows, :w], new_positions[rows, :w]  # [n, w]
        cos, sin = rerotation_tables(self.rope, old_p, new_p, self.table_len[rows], new_lens[rows])  # [n, w, r/2]
        pairing = stored_pairing(self.rope)
        for store in self.k:
            k = apply_rope(store.read(w)[rows].float(), cos, sin, pairing=pairing)  # [n, hk, w, d]
            store.rewrite(rows, w, k)

    def clear(self, rows: torch.Tensor | None = None) -> None:
        if rows is None:
            rows = torch.ones_like(self.lengths, dtype=torch.bool)
        elif not isinstance(rows, torch.Tensor) or rows.dtype != torch.bool or rows.shape != self.lengths.shape:
            fail("rows", f"None or a bool tensor of shape [{self.batch_size}]", rows)
        self.positions[rows] = -1
        self.tokens[rows] = -1
        self.lengths[rows] = 0
        self.table_len[rows] = 0
        for store in self.k + self.v:
            store.clear(rows)

    def keep(self, keep: torch.Tensor) -> None:
        """As `KVCache.keep`: codes move with their slots; nothing is re-encoded."""
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != self.positions.shape:
            fail("keep", f"a bool tensor of shape {tuple(self.positions.shape)}", keep)
        keep = keep & self.valid()
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept slots first, in order
        kept = keep.gather(1, order)  # [b, cap]
        self.positions = self.positions.gather(1, order).masked_fill(~kept, -1)
        self.tokens = self.tokens.gather(1, order).masked_fill(~kept, -1)
        self.lengths = keep.sum(dim=1)
        for store in self.k + self.v:
            store.keep(keep, order, kept)
