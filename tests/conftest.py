"""Shared fixtures; the tolerance table and the oracles live in tests/helpers/."""

import pytest
import torch


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# The suite runs tiny tensors: one intra-op thread avoids thread start-up and contention costs on the
# 2-core CI machine (measured 17x slower forwards with 2 threads while another process ran).
torch.set_num_threads(1)
