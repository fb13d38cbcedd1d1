"""Cache policies for a length-dependent RoPE rule (dynamic NTK, LongRoPE) inside a patched transformers model.

Such a rule picks its frequencies from the sequence length (`max(position_ids) + 1`, over the batch, as a
fresh full forward of transformers takes it). With a cache, the length grows while the cached keys, and
the hidden states every later layer computed from them, carry the table of the length they were made at.
Stock transformers re-derives the table and keeps the cache, so a cached step differs from a fresh full
forward over the same tokens. Under a patch, the policy decides, as `posenc.KVCache` does:
- "recompute": when the table changes, the cached tokens are run again under the new table (their inputs are
  recorded): every cached step equals a fresh full forward. Cost: one forward over the sequence per table
  change (LongRoPE: once, at `original_max_position_embeddings`; dynamic NTK: every step past it);
- "rerotate": the cached keys are turned from the old table to the new one (`posenc.rerotate`); the hidden
  states behind them keep the old table (cheap, approximate);
- "freeze": the table chosen when the cache was first filled is kept (consistent, no switch);
- "refuse": a forward that would change the table raises `PosencError`.

Each cache carries a `Record` (attribute `posenc_record`): the positions of its tokens, their input
embeddings (recompute only), the length whose table its keys carry, and the 2-d padding mask `generate()`
last held (recompute: a re-run forward needs it when `generate()` passes a prepared 4-d mask, as it does for
a static cache, whose slots the re-run writes again from 0). The cache's own `crop`,
`reorder_cache`, `batch_repeat_interleave`, `batch_select_indices` and `reset` (assisted decoding, beam
search) are wrapped on that cache instance so the record follows them.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import Raw, fail
from ...rope.rerotate import rerotate
from ...rope.spec import Rope

__all__ = ["Record", "same_table", "RECORD_ATTR"]

RECORD_ATTR = "posenc_record"
_FOLLOWED = ("crop", "reorder_cache", "batch_repeat_interleave", "batch_select_indices", "reset")


@dataclass
class Record:
    """What posenc remembers about one transformers cache."""

    positions: torch.Tensor | None = None  # [b, n] or [3, b, n] int64: every cached token's position
    embeds: torch.Tensor | None = None  # [b, n, hidden]: their inputs (policy "recompute")
    table_len: int | None = None  # the sequence length whose table the cached keys carry
    # [b, n] the 0/1 mask generate() passed to prepare_inputs_for_generation (it prepares a 4-d one for a
    # static cache): what a re-run forward reads; kept through `clear` (it is set before the forward)
    padding: torch.Tensor | None = None
    top: int | None = None  # max(positions) + 1 of the cached tokens (None: read it from `positions`)
    space: torch.Tensor | None = None  # [b, capacity, hidden]: `embeds` is its first n columns (amortized appends)

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    def clear(self) -> None:
        self.positions = self.embeds = self.table_len = self.top = self.space = None

    def end(self) -> int:
        """`max(positions) + 1` of the cached tokens (one host read, kept until an edit)."""
        if self.top is None:
            self.top = int(rope_positions(self.positions).max()) + 1
        return self.top

    def append(self, positions: torch.Tensor, embeds: torch.Tensor | None, table_len: int | None,
               top: int | None = None) -> None:
        """Add tokens; `top`: `max(positions) + 1` over every token after this one, when the caller knows it."""
        self.positions = positions if self.positions is None else torch.cat((self.positions, positions), dim=-1)
        if embeds is not None:
            self.embeds = embeds if self.embeds is None else self._grown(embeds)
        self.table_len, self.top = table_len, top

    def _grown(self, new: torch.Tensor) -> torch.Tensor:
        """`embeds` followed by `new` (dim 1), written into `space` (made again, doubling, when it cannot hold
        them): a decode step copies its own token, not the whole record."""
        old, space = self.embeds, self.space
        n, t = old.shape[1], new.shape[1]
        if new.requires_grad or old.requires_grad:
            return torch.cat((old, new), dim=1)
        if (space is None or space.shape[1] < n + t or space.data_ptr() != old.data_ptr()
                or space.shape[::2] != old.shape[::2] or space.dtype != new.dtype or space.device != new.device
                or old.stride() != space[:, :n].stride() or space.is_inference() != torch.is_inference_mode_enabled()):
            space = self.space = old.new_empty((old.shape[0], max(2 * (n + t), 64), old.shape[2]))
            space[:, :n] = old
        space[:, n:n + t] = new
        return space[:, :n + t]
    @staticmethod
    def of(cache: Any) -> "Record":
        """The cache's record, attached (with the cache's row and length edits followed) on first use."""
        record = cache.__dict__.get(RECORD_ATTR)
        if record is None:
            record = Record()
            for name in _FOLLOWED:
                if callable(getattr(cache, name, None)):
                    setattr(cache, name, types.MethodType(_followed(name, getattr(type(cache), name)), cache))
            setattr(cache, RECORD_ATTR, record)
        return record

    def edit(self, name: str, cache: Any, arg: Any) -> None:
        """Apply to the record what the cache method `name(arg)` did to the cache."""
        if name == "reset" or self.positions is None:
            self.clear()
            return
        self.top = None  # read again from the edited positions
        if name == "crop":
            n = cache.get_seq_length()
            self.positions = self.positions[..., :n]
            self.embeds = None if self.embeds is None else self.embeds[:, :n]
            return
        self.positions = _rows(self.positions, -2, name, arg)  # [..., b, n]
        self.embeds = None if self.embeds is None else _rows(self.embeds, 0, name, arg)  # [b, n, hidden]


def _rows(x: torch.Tensor, axis: int, name: str, arg: Any) -> torch.Tensor:
    """`x` with its batch rows edited as `reorder_cache(beam_idx)`, `batch_select_indices(indices)` or
    `batch_repeat_interleave(repeats)` edit the cache's."""
    if name == "batch_repeat_interleave":
        return x.repeat_interleave(int(arg), dim=axis)
    return x.index_select(axis, torch.as_tensor(arg, device=x.device).long())


def _followed(name: str, method: Any) -> Any:
    def follow(self: Any, arg: Any = None, *args: Any, **kwargs: Any) -> Any:
        out = method(self, *args, **kwargs) if name == "reset" else method(self, arg, *args, **kwargs)
        self.__dict__[RECORD_ATTR].edit(name, self, arg)
        return out

    return follow


def same_table(rope: Rope, a: int | None, b: int | None) -> bool:
    """Whether the rule gives the same table at lengths a and b."""
    if a == b:
        return True
    (inv_a, fa), (inv_b, fb) = rope.inv_freq(a), rope.inv_freq(b)
    return fa == fb and torch.equal(inv_a, inv_b)


def rope_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The positions a rotation reads: Qwen2-VL's packed `[4, b, t]` carries text positions in row 0."""
    return position_ids[1:] if position_ids.ndim == 3 and position_ids.shape[0] == 4 else position_ids


def decide(rope: Rope, record: Record, positions: torch.Tensor, policy: str) -> tuple[int, bool]:
    """`(table length for this forward, whether the cached tokens must run again)` under `policy`."""
    new = int(rope_positions(positions).max()) + 1
    if record.length == 0:
        return new, False
    length = max(new, record.end())
    old = record.table_len
    if same_table(rope, old, length):
        return length, False
    if policy == "freeze":
        return old, False
    if policy == "refuse":
        fail("cache", f"a cache whose RoPE table stays the one its keys were rotated with (policy='refuse'; "
             f"the cached keys use the {rope.scaling.name} table of length {old})",
             Raw(f"a forward reaching length {length}, whose table differs"))
    return length, policy == "recompute"


def rerotate_cache(cache: Any, layer_ropes: dict[int, Rope], record: Record, old: int, new: int) -> None:
    """Turn each listed layer's cached keys from the table of length `old` to that of `new` (policy "rerotate")."""
    for index, rope in layer_ropes.items():
        layer = cache.layers[index]
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.ndim != 4 or keys.shape[-2] > record.length:
            fail("cache", "a cache whose layers keep keys [b, hk, n, d] (DynamicCache) for policy='rerotate'",
                 Raw(f"{type(cache).__name__} layer {index}"))
        where = record.positions[..., -keys.shape[-2]:]  # a sliding-window layer keeps the last tokens
        layer.keys = rerotate(rope, keys, where, where, old_seq_len=old, new_seq_len=new)
