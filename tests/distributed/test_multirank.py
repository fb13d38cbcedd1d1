"""posenc.distributed on real gloo ranks: ONE spawn of 4 CPU ranks runs every case (tests/helpers/distributed_cases.py);
CP=4 on the world and CP=2 on two subgroups. Each test asserts on the numbers a case returned.

Oracles: single-process `posenc.attention` on the whole sequence (per document for packed input) and
PyTorch's own `context_parallel` buffer sharding. Float64 tolerance from the suite's table (1e-10); the
T5 table's gradient is float32 arithmetic in posenc (its bias is computed in float32), so it uses the
float32 row. Controls (local positions, a shard's own length) must miss by a wide margin.
"""

import os
import time

import pytest
import torch
from tests.helpers.tolerances import TOL

import tests.helpers.distributed_cases as cases
from posenc.distributed import shard_positions
from posenc.distributed.testing import SpawnError, SpawnUnavailable, spawn

ATOL64 = TOL[torch.float64][0]
ATOL32 = TOL[torch.float32][0]
GROUPS = ("cp4", "cp2")


@pytest.fixture(scope="module")
def results():
    try:
        return spawn(cases.run_all, 4, timeout_s=240)  # never hangs: the ranks are killed past the timeout
    except SpawnUnavailable as e:
        pytest.skip(f"cannot spawn gloo ranks here: {e}")


def _expected_names():
    names = [f"ring-{lay}-{enc}" for lay in ("zigzag", "contiguous") for enc in cases.encodings()]
    names += [f"ulysses-{lay}-{enc}" for lay in ("zigzag", "contiguous") for enc in ("rope", "yarn", "alibi", "t5")]
    names += [f"packed-zigzag-{enc}" for enc in ("rope", "alibi", "t5")] + ["packed-contiguous-rope"]
    names += ["ring-zigzag-alibi-window-batch2", "ring-zigzag-t5-bidirectional", "ulysses-zigzag-alibi-sdpa",
              "ring-zigzag-alibi-keymask", "ulysses-contiguous-rope-keymask"]
    return names


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("case", _expected_names())
def test_sharded_forward_and_backward_equal_single_process(results, group, case):
    for rank, result in enumerate(results):
        report = result[group][case]
        for quantity in ("out", "dq", "dk", "dv"):
            assert report[quantity] <= ATOL64, (rank, quantity, report)
        assert report["dparam"] <= ATOL32, (rank, report)  # T5 table gradient, summed over the CP group


@pytest.mark.parametrize("group", GROUPS)
def test_float32_ring_within_float32_tolerance(results, group):
    for result in results:
        report = result[group]["ring-zigzag-mha-float32"]
        assert max(report.values()) <= ATOL32, report


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("case", ["control-local-positions-rope", "control-local-positions-alibi",
                                  "control-local-positions-t5", "control-local-length-dynamic"])
def test_controls_are_caught(results, group, case):
    # at least one rank's output is far off: the comparison can fail, and these mistakes are real
    assert max(result[group][case]["out"] for result in results) > 0.05


@pytest.mark.parametrize("group, size", [("cp4", 4), ("cp2", 2)])
def test_pytorch_context_parallel_shards_positions_like_zigzag(results, group, size):
    seq = cases.SEQ[size]
    for rank, result in enumerate(results):
        cp_rank = rank if size == 4 else rank % 2
        mine = shard_positions(seq, size, cp_rank).tolist()
        assert result[group]["shard_positions"] == mine
        assert result[group][f"context_parallel-positions-{seq}"] == mine  # PyTorch's head-tail buffer sharding
        assert result[group]["flex-positions"] == mine
        # a length that is not a multiple of 2W: PyTorch silently shards contiguously (posenc raises instead)
        odd = seq + size
        assert result[group][f"context_parallel-positions-{odd}"] == shard_positions(odd, size, cp_rank,
                                                                                     "contiguous").tolist()


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("encoding", ["alibi", "t5"])
def test_flex_context_parallel_bias_equals_single_process(results, group, encoding):
    for result in results:
        assert result[group][f"flex-{encoding}"]["out"] <= ATOL64
    assert max(result[group]["control-flex-local-positions-alibi"]["out"] for result in results) > 0.05


def test_spawn_reports_a_failing_rank_with_its_traceback():
    try:
        with pytest.raises(SpawnError, match=r"(?s)1 rank\(s\) failed.*--- rank 1 ---.*ValueError: rank one fails"):
            spawn(cases.fail_on_rank_one, 2, timeout_s=120)
    except SpawnUnavailable as e:
        pytest.skip(f"cannot spawn gloo ranks here: {e}")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("POSENC_SLOW"), reason="slow: set POSENC_SLOW=1 to run")
def test_spawn_never_hangs():
    start = time.monotonic()
    try:
        with pytest.raises(SpawnError, match=r"no report from ranks \[0"):
            spawn(cases.hang_on_rank_zero, 2, timeout_s=30, retries=0)
    except SpawnUnavailable as e:
        pytest.skip(f"cannot spawn gloo ranks here: {e}")
    assert time.monotonic() - start < 60
