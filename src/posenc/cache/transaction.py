"""All or nothing for a `KVCache`: snapshots of its state and the undo journal behind `KVCache.transaction()`.

A `Snapshot` of an object holds, for it and every cache object it reaches (stores, block tables, quantized
parts), each attribute's value and a clone of every tensor attribute; `restore()` puts the very same tensor
objects back and copies the clones into them, so references a caller holds stay the cache's own and every
tensor, statistic, block table and counter is bit-identical to the moment of the snapshot.

A `Journal` is what a transaction keeps: at its start a snapshot of the cache's bookkeeping (positions,
tokens, lengths, table_len, counters, block tables; small next to the keys and values), then one undo per
write (a store's `save(rows, slots)`: the entries that write will overwrite, so a decode step costs the
size of its new tokens, not of the cache) or, the first time an edit touches the stores (`grow`, `clear`,
`keep`, a re-rotation...), one full snapshot of the stores, after which nothing more needs recording.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from .kvcache import KVCache

__all__ = ["Snapshot", "Journal", "Transaction", "before_edit"]

Undo = Callable[[], None]


def _owned(value: Any) -> bool:
    """Objects a snapshot walks into: instances of posenc's cache classes (stores, tables, parts); frozen
    values (dataclasses such as a `KVFormat`) are held, not walked."""
    return (hasattr(value, "__dict__") and type(value).__module__.startswith("posenc.cache")
            and not dataclasses.is_dataclass(value))


class Snapshot:
    """Every attribute of `root` and of the cache objects it reaches (lists of them too), tensors cloned.

    Args:
        root: the object to snapshot (a `KVCache`, a store).
        skip: attribute names of `root` not to walk or restore (e.g. "stores" for bookkeeping only).
    """

    def __init__(self, root: Any, skip: tuple[str, ...] = ()) -> None:
        self.entries: list[tuple[Any, dict[str, Any], dict[str, torch.Tensor]]] = []
        seen: set[int] = set()
        todo = [(root, skip)]
        while todo:
            obj, omit = todo.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            values = {name: value for name, value in vars(obj).items() if name not in omit and name != "journal"}
            clones = {name: value.clone() for name, value in values.items() if isinstance(value, torch.Tensor)}
            self.entries.append((obj, values, clones))
            for name, value in values.items():
                for item in value if isinstance(value, (list, tuple)) else (value,):
                    if _owned(item) or (name == "stores" and hasattr(item, "__dict__")):  # any KVStore
                        todo.append((item, ()))

    def restore(self) -> None:
        """Put back every attribute and the contents of every tensor as they were at the snapshot."""
        for obj, values, clones in self.entries:
            for name, value in values.items():
                setattr(obj, name, value)
            for name, clone in clones.items():
                values[name].copy_(clone)


class Journal:
    """The undo log of one transaction over `cache` (see the module docstring)."""

    def __init__(self, cache: "KVCache") -> None:
        self.undo: list[Undo] = [Snapshot(cache, skip=("stores",)).restore]
        self.cache, self.full = cache, False

    def before_write(self, store: Any, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Record what `store.write(rows, slots, ...)` will overwrite (`store.save`, or a snapshot of it)."""
        if not self.full:
            self.undo.append(store.save(rows, slots) if hasattr(store, "save") else Snapshot(store).restore)

    def before_edit(self) -> None:
        """Snapshot every store once: an edit may touch any slot (later writes need no record)."""
        if not self.full:
            self.undo.append(Snapshot(self.cache).restore)
            self.full = True

    def record(self, undo: Undo) -> None:
        """Add an undo of the caller's own (e.g. a paged store's blocks before copy-on-write)."""
        if not self.full:
            self.undo.append(undo)

    def rollback(self) -> None:
        """Undo everything recorded, newest first."""
        for undo in reversed(self.undo):
            undo()


def before_edit(cache: "KVCache") -> None:
    """Called by an edit before it first touches the stores: inside a transaction, snapshot them (once)."""
    if cache.journal is not None:
        cache.journal.before_edit()


class Transaction:
    """The context manager `KVCache.transaction()` returns: opens the cache's journal, undoes it on an exception."""

    def __init__(self, cache: "KVCache") -> None:
        self.cache = cache

    def __enter__(self) -> "KVCache":
        self.cache.journal = Journal(self.cache)
        return self.cache

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        journal, self.cache.journal = self.cache.journal, None
        if kind is not None:
            journal.rollback()
