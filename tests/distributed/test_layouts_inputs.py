"""Sharding's inputs: sizes beyond int64, bad dims and lengths refused by name; negative dims still round-trip."""

import pytest
import torch

from posenc import PosencError
from posenc.distributed.layouts import shard, unshard

HUGE = 2**70  # a Python int no int64 tensor or torch size can hold


@pytest.mark.parametrize("args, arg", [((HUGE, 2, 0), "seq_len"), ((8, HUGE, 0), "cp_size"), ((8, 2, HUGE), "cp_rank")])


def test_shard_positions_refuses_integers_beyond_int64_by_name(args, arg):
    from posenc.distributed import shard_positions
    with pytest.raises(PosencError, match=rf"^{arg}: expected"):
        shard_positions(*args)


@pytest.mark.parametrize("call, arg", [
    (lambda: shard(torch.zeros(4, 8), 5, 2, 0), "dim"),
    (lambda: shard(torch.zeros(4, 8), -3, 2, 0), "dim"),
    (lambda: shard(torch.zeros(4, 8), 1.0, 2, 0), "dim"),
    (lambda: shard(torch.tensor(1.0), 0, 2, 0), "x"),
    (lambda: unshard([torch.zeros(4, 4), torch.zeros(4, 4)], 5), "dim"),
    (lambda: unshard([torch.tensor(1.0), torch.tensor(2.0)], 0), "shards"),
    (lambda: unshard([[1, 2], [3, 4]], 0), "shards"),
    (lambda: unshard([torch.zeros(2, 4), torch.zeros(3, 4)], 1), "shards"),
    (lambda: unshard([torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float64)], 1), "shards"),
    (lambda: unshard([torch.zeros(2, 4), torch.zeros(2, 4, 1)], 1), "shards"),
], ids=["dim-5", "dim-neg", "dim-float", "0-d", "un-dim-5", "un-0-d", "un-lists", "un-shapes", "un-dtypes", "un-ranks"])


def test_shard_and_unshard_refuse_bad_arguments_by_name(call, arg):
    with pytest.raises(PosencError) as err:
        call()
    assert err.value.arg == arg, str(err.value)


def test_shard_and_unshard_still_round_trip_with_negative_dims():
    x = torch.arange(24.0).reshape(2, 12)
    parts = [shard(x, -1, 3, r) for r in range(3)]
    assert torch.equal(unshard(parts, -1), x)
