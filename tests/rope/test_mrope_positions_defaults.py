"""`mrope_position_ids`'s defaults: an empty text segment adds no positions, one second per video grid."""

import pytest
import torch

from posenc import PosencError, mrope_position_ids, mrope_segment_positions


def test_empty_text_segment_adds_no_positions():
    """rope/mrope_positions.py: a text segment's count may be 0 (mutant: min 0 -> 1 refused it)."""
    pos, nxt = mrope_segment_positions([("text", 2), ("text", 0), ("text", 1)], start=4)
    assert pos.tolist() == [[4, 5, 6]] * 3 and nxt == 7
    with pytest.raises(PosencError, match=r"^segments\[0\]"):
        mrope_segment_positions([("text", -1)])


def test_video_seconds_default_to_one_per_grid():
    """rope/mrope_positions.py `[1.0] * n_videos` (mutant 2.0): without second_per_grid_ts a grid step is 1 s."""
    ids = torch.tensor([[1, 151652] + [151656] * 3 + [2]])  # text, vision start, 3 video tokens (grid 3x2x2, merge 2)
    kw = dict(video_grid_thw=[[3, 2, 2]], image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
              tokens_per_second=2)
    default, _ = mrope_position_ids(ids, **kw)
    explicit, _ = mrope_position_ids(ids, second_per_grid_ts=[1.0], **kw)
    assert torch.equal(default, explicit)
    assert default[0, 0, 2:5].tolist() == [2, 4, 6]  # temporal index: frame t at 2 + t * 1 s * 2 tokens/s
