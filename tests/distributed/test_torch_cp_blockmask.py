"""PyTorch's FlexAttention context parallelism with its compiled CP BlockMask plus posenc's ALiBi / T5
score_mods, on 2 gloo ranks, against single-process `posenc.attention` (float32 tolerance).

Slow and opt-in (about a minute: `create_block_mask` is compiled by PyTorch's CP code and needs a C++
toolchain). Run it with:

    POSENC_SLOW=1 python -m pytest tests/distributed/test_torch_cp_blockmask.py -q
"""

import os

import pytest
import torch
from tests.helpers.tolerances import TOL

import tests.helpers.distributed_flex_blockmask_cases as cases
from posenc.distributed.testing import SpawnUnavailable, spawn

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("POSENC_SLOW"), reason="slow: set POSENC_SLOW=1 to run")]


def test_flex_cp_with_block_mask_and_position_score_mods():
    try:
        results = spawn(cases.run, 2, timeout_s=600)
    except SpawnUnavailable as e:
        pytest.skip(f"cannot spawn gloo ranks here: {e}")
    for report in results:
        assert report["alibi"] <= TOL[torch.float32][0], report
        assert report["t5"] <= TOL[torch.float32][0], report
