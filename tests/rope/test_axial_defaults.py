"""`vision_patch_positions`'s default merge of 2x2 patches (Qwen2-VL)."""

import torch

from posenc import vision_patch_positions


def test_vision_patch_positions_merge_default_is_two():
    """rope/axial.py `spatial_merge_size: int = 2` (mutant 3): Qwen2-VL's default merge of 2x2 patches."""
    grid = torch.tensor([[1, 4, 4]])
    assert torch.equal(vision_patch_positions(grid), vision_patch_positions(grid, spatial_merge_size=2))
