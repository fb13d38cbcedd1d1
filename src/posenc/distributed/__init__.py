"""Positions and position biases under context and sequence parallelism.

posenc does not own process groups, launching or a production kernel. It gives every rank global
positions (`shard_positions`, `shard_varlen`), encodings and biases computed from them
(`encode_shard`, `shard_cos_sin`, `HeadSlice`), a reference ring and Ulysses attention on stock
`torch.distributed` (`ring_attention`, `ulysses_attention`, the same arguments as
`posenc.attention.attention`), and the glue for PyTorch's own context parallelism
(`posenc.distributed.torch_cp`). Not imported by `import posenc`; see docs/distributed.md.

    >>> from posenc.distributed import shard_positions
    >>> shard_positions(16, 4, 1).tolist()   # chunks 1 and 6 of 8: TransformerEngine's DualChunkSwap
    [2, 3, 12, 13]
"""

from .collectives import all_gather_seq, all_reduce_grads, heads_to_seq, ring_shift, seq_to_heads
from .encodings import HeadSlice, encode_shard, shard_cos_sin
from .layouts import SHARD_LAYOUTS, VarlenShard, head_slice, shard, shard_positions, shard_varlen, unshard, unshard_index
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = [
    "SHARD_LAYOUTS",
    "shard_positions",
    "shard",
    "unshard",
    "unshard_index",
    "VarlenShard",
    "shard_varlen",
    "head_slice",
    "HeadSlice",
    "shard_cos_sin",
    "encode_shard",
    "ring_attention",
    "ulysses_attention",
    "ring_shift",
    "seq_to_heads",
    "heads_to_seq",
    "all_gather_seq",
    "all_reduce_grads",
]
