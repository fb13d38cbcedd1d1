"""Tests written for mutants that `tools/mutate.py` found surviving the rest of the suite (see docs/mutation.md).

Each test names the mutant it kills (file:line as found, the mutation); the behaviour it pins is documented.
"""

import torch

from posenc.cache import KVCache


def test_fresh_cache_marks_every_slot_empty_and_unknown():
    """cache.py `self.tokens = torch.full(..., -1)`, mutant -1 -> 0: a fresh slot's token id is unknown (-1)."""
    cache = KVCache(2, 3, 1, 4, capacity=5)
    assert torch.equal(cache.tokens, torch.full((3, 5), -1))
    assert torch.equal(cache.positions, torch.full((3, 5), -1))
    cache.reserve(torch.tensor([[7, 8]]).expand(3, 2))  # positions without token ids: the ids stay unknown
    assert torch.equal(cache.tokens, torch.full((3, 5), -1))
    assert torch.equal(cache.positions[:, :2], torch.tensor([[7, 8]] * 3))
