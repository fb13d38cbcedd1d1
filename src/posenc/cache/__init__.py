"""posenc's KV cache: logical positions per slot over pluggable per-layer storage.

- `kvcache.py`: `KVCache`, the bookkeeping (positions, tokens, lengths, tables) and the append path.
- `storage.py`: the `KVStore` protocol and `ContiguousStore` (`[b, hk, capacity, d]` per layer).
- `paged.py`: `BlockTable` and `PagedStore` (blocks, block tables, copy-on-write forks).
- `policy.py`: what happens when a row's RoPE table changes. `edit.py`: windows, rollback, reorder, moves.
- `checks.py`: validation of new tokens without a host sync, shared with the decoder's no-cache forward;
  `check_model_cache`, a model's check that a cache fits it.
- `transaction.py`: snapshots and the undo journal behind `KVCache.transaction()` (all or nothing).
"""

from .checks import check_model_cache, check_new_positions
from .kvcache import INITIAL_CAPACITY, POLICIES, STORES, KVCache
from .paged import BlockTable, PagedStore
from .storage import ContiguousStore, KVStore

__all__ = ["KVCache", "STORES", "POLICIES", "INITIAL_CAPACITY", "KVStore", "ContiguousStore", "PagedStore",
           "BlockTable", "check_new_positions", "check_model_cache"]
