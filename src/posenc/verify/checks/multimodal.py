"""`multimodal`: M-RoPE coordinates (Qwen2-VL's 3-axis positions) stay consistent under crops, tiles and frames.

Integer invariants, so the threshold is exact equality (0 violations):
- text only: the three axes equal each other and the 1-D positions 0..t-1;
- an image block: temporal axis constant, height/width axes follow the merged patch grid row by row;
  a crop (fewer rows/cols) gives the same coordinates for the patches it keeps; the text after a block
  resumes one past the block's largest coordinate;
- tiles: two images in one prompt each carry the same relative grid, the second starting past the first;
- frames: every frame of a video repeats the spatial grid, the temporal axis steps up once per frame.
Flattening the coordinates to 1-D (a common shortcut) breaks every vision invariant.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .common import Budget, Row, Subject

__all__ = ["multimodal", "flat_positions"]

TEXT, START, IMAGE, VIDEO = 7, 1, 2, 3
MERGE = 2


def _block(kind: int, t: int, h: int, w: int) -> list[int]:
    return [START] + [kind] * (t * h * w // MERGE**2)


def _call(builder: Callable[..., Any], ids: list[int], images=None, videos=None) -> torch.Tensor:
    pos, _ = builder(torch.tensor([ids]), image_grid_thw=images, video_grid_thw=videos, image_token_id=IMAGE,
                     video_token_id=VIDEO, vision_start_token_id=START, spatial_merge_size=MERGE)
    return pos[:, 0]  # [3, t]


def _grid(pos: torch.Tensor, first: int, t: int, h: int, w: int) -> torch.Tensor:
    """Coordinates of a block's tokens relative to its first token, `[3, n]`."""
    n = t * h * w // MERGE**2
    block = pos[:, first:first + n]
    return block - block[:, :1]


def _expected(t: int, h: int, w: int) -> torch.Tensor:
    hh, ww = h // MERGE, w // MERGE
    i = torch.arange(t * hh * ww)
    return torch.stack((i // (hh * ww), (i // ww) % hh, i % ww))  # [3, n]


def violations(builder: Callable[..., Any]) -> dict[str, bool]:
    """Each invariant -> True when it holds."""
    ok: dict[str, bool] = {}
    text = _call(builder, [TEXT] * 9)
    ok["text-only equals 1-D"] = bool((text == torch.arange(9)).all())
    ids = [TEXT] * 3 + _block(IMAGE, 1, 8, 6) + [TEXT] * 4
    full = _call(builder, ids, images=[[1, 8, 6]])
    ok["image grid"] = torch.equal(_grid(full, 4, 1, 8, 6), _expected(1, 8, 6))
    ok["text resumes after image"] = int(full[0, -4]) == int(full[:, :-4].max()) + 1 and \
        bool((full[:, -4:] == full[0, -4:]).all())
    crop = _call(builder, [TEXT] * 3 + _block(IMAGE, 1, 4, 6) + [TEXT] * 4, images=[[1, 4, 6]])
    kept = _grid(full, 4, 1, 8, 6)[:, :6]  # the first 2 merged rows of 3 patches
    ok["crop keeps coordinates"] = torch.equal(_grid(crop, 4, 1, 4, 6), kept) and \
        torch.equal(crop[:, 4:10], full[:, 4:10])
    two = [TEXT] * 2 + _block(IMAGE, 1, 4, 4) + [TEXT] + _block(IMAGE, 1, 4, 4) + [TEXT]
    tiles = _call(builder, two, images=[[1, 4, 4], [1, 4, 4]])
    second = 2 + 1 + 4 + 1 + 1
    ok["tiles repeat the grid"] = torch.equal(_grid(tiles, 3, 1, 4, 4), _grid(tiles, second, 1, 4, 4)) and \
        int(tiles[:, second:second + 4].min()) > int(tiles[:, 3:7].max())
    video = _call(builder, [TEXT] * 2 + _block(VIDEO, 3, 4, 4) + [TEXT], videos=[[3, 4, 4]])
    ok["frames repeat the grid, time steps"] = torch.equal(_grid(video, 3, 3, 4, 4), _expected(3, 4, 4))
    return ok


def flat_positions(input_ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1-D shortcut (every axis = the token index): what the `multimodal` row must reject."""
    b, t = input_ids.shape
    pos = torch.arange(t).expand(3, b, t)
    return pos, torch.zeros(b, 1, dtype=torch.long)


def multimodal(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    from ...rope.mrope_positions import mrope_position_ids

    builder = subject.mrope_builder or getattr(subject.engine(None), "mrope_position_ids", None) or mrope_position_ids
    ok = violations(builder)
    broken = [k for k, v in ok.items() if not v]
    if progress:
        progress()
    return Row("multimodal", not broken,
               measured={"invariants_checked": len(ok), "violations": len(broken), "broken": broken},
               thresholds={"violations": "== 0 (integer coordinates)"},
               explanation="M-RoPE position builder: text-only = 1-D; image grid, crop, tiles and video frames "
                           "keep consistent (t, h, w) coordinates",
               details={"invariants": ok, "builder": getattr(builder, "__qualname__", str(builder))})
