"""Shared test helpers: the one per-dtype tolerance table, seeded generators."""

import pytest
import torch

# One table of tolerances (atol, rtol) per dtype, used by every comparison in the suite.
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1.3e-6),
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
}


def assert_close(actual, expected, dtype=None, msg=""):
    dtype = dtype or expected.dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol, rtol=rtol, msg=msg or None)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# The suite runs tiny tensors: one intra-op thread avoids thread start-up and contention costs on the
# 2-core CI machine (measured 17x slower forwards with 2 threads while another process ran).
torch.set_num_threads(1)
