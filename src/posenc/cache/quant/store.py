"""Quantized per-layer storage for `KVCache`: `QuantStore`, a `posenc.cache.KVStore` over two parts.

Keys are a `posenc.cache.quant.channels.ChannelStore` (per channel, in blocks of `group` tokens, before RoPE) or a
`posenc.cache.quant.tokens.TokenStore` (per token); values are always a `TokenStore`. `QuantizedKVCache` passes
`QuantStore` to `KVCache(make_store=...)`, so the cache's own append path, edits and policies run over it.

Host syncs: `write` and `read` make none, for every format and both key layouts: the value range and the
per-channel slot order are checked on the device (`formats.check_block`, `ChannelStore.check_slots`:
PosencError at once on the CPU, `torch._assert_async` on an accelerator), and the per-channel key store
appends every row at once. `copy_slots` and `reorder` make none with per-token keys; the per-channel key
store reclaims its statistics pool there (one sync: they are edits), so that appends never need to.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..storage import check_copy
from .channels import RESIDUAL, ChannelStore
from .tokens import TokenStore
from .formats import KVFormat

__all__ = ["QuantStore", "TokenStore", "ChannelStore", "DEFAULT_GROUP", "RESIDUAL"]

DEFAULT_GROUP = 64  # tokens per per-channel block: its d float16 stats cost as much per token as per-token stats at d=64


class QuantStore:
    """One layer's quantized keys and values: a `KVStore` (see `posenc.cache.storage`) over two parts.

    Args:
        batch_size, num_kv_heads, capacity, head_dim, value_dim: b, hk, slots per row, d, dv (default d).
        dtype, device: the compute dtype (`read` returns it; the per-channel residual keeps it), the device.
        layers: unused (the `ContiguousStore` signature). fmt: the `KVFormat`. group: tokens per key block.
        key_axis: "channel" (keys per channel in blocks, before RoPE) or "token".
    Attributes:
        keys: a `ChannelStore` or `TokenStore`; values: a `TokenStore`.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, capacity: int, head_dim: int,
                 value_dim: int | None = None, *, dtype: torch.dtype = torch.float32, device: Any = None,
                 layers: int = 1, fmt: KVFormat, group: int = DEFAULT_GROUP, key_axis: str = "token") -> None:
        b, hk, dv = batch_size, num_kv_heads, head_dim if value_dim is None else value_dim
        if key_axis == "channel":
            self.keys: TokenStore | ChannelStore = ChannelStore(fmt, (b, hk, capacity, head_dim), dtype, device, group)
        else:
            self.keys = TokenStore(fmt, (b, hk, capacity, head_dim), dtype, device)
        self.values = TokenStore(fmt, (b, hk, capacity, dv), dtype, device)

    @property
    def capacity(self) -> int:
        return self.keys.capacity

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def write(self, rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """As `KVStore.write`; keys and values are checked (format range, per-channel slot order) before
        anything is written, on the device: on the CPU a refused call raises PosencError and changes nothing;
        on an accelerator the failure surfaces at the next synchronisation (no host sync here)."""
        self.keys.check(k, "k")
        if v is not None:
            self.values.check(v, "v")
        if isinstance(self.keys, ChannelStore):
            self.keys.check_slots(rows, slots)
        self.keys.write(rows, slots, k)
        if v is not None:
            self.values.write(rows, slots, v)

    def save(self, rows: torch.Tensor, slots: torch.Tensor) -> Callable[[], None]:
        """`KVStore.save`: both parts' entries a write to `(rows, slots)` would change."""
        undo_keys, undo_values = self.keys.save(rows, slots), self.values.save(rows, slots)

        def undo() -> None:
            undo_values()
            undo_keys()

        return undo

    def read(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`KVStore.read`: only the first `width` slots (default all) are decoded."""
        return self.keys.read(width), self.values.read(width)  # fresh [b, hk, w, d], [b, hk, w, dv]

    def copy_slots(self, src_rows: torch.Tensor, src_slots: torch.Tensor, dst_rows: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
        check_copy(src_rows, src_slots, dst_rows, dst_slots, self.keys.shape[0], self.capacity)
        for part in (self.keys, self.values):
            part.copy(src_rows, src_slots, dst_rows, dst_slots)

    def reorder(self, index: torch.Tensor) -> None:
        for part in (self.keys, self.values):
            part.reorder(index)

    def grow(self, capacity: int) -> None:
        for part in (self.keys, self.values):
            part.grow(capacity)
