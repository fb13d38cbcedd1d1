"""Multi-axis positions for the Qwen2-VL family: text, image and video tokens to `[3, b, t]` positions.

Positions (Qwen's `get_rope_index`, as transformers 4.49-4.51 shipped it):
- a text run of n tokens takes `start, start+1, ..., start+n-1` on all three axes;
- a vision block with grid (T, H, W) and merge size m has `T * H/m * W/m` tokens laid out
  frame-major, then row, then column; token (f, y, x) sits at `(start + time(f), start + y, start + x)`;
- the token after a block starts at the block's largest position + 1 (over all three axes);
- `time(f) = f` (Qwen2-VL, `tokens_per_second=None`), or, with `tokens_per_second` (Qwen2.5-VL),
  `trunc(f * second_per_grid * tokens_per_second)` for videos and 0 for still images. The product is
  computed as the reference computes it: float32 for Python numbers and float32 tensors (so 1.3 is
  float32(1.3)), in the tensor's own dtype otherwise;
- Qwen3-VL / Qwen3.5 (`timestamps=True`): a video of T temporal patches is written as T single-frame blocks,
  each after its own timestamp text (`<t1> <vision_start> frame 1 <vision_end> <t2> <vision_start> ...`), so
  time lives in the text; each frame block is placed as a (1, H, W) image by the rule above (every token of a
  frame shares the T position of the frame's start).

    >>> pos, next_start = mrope_segment_positions([("text", 2), ("image", 1, 4, 4), ("text", 1)])
    >>> pos.tolist(), next_start
    ([[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]], 5)
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import torch

from ..errors import boolean, fail, integer, integer_tensor, real

__all__ = ["mrope_segment_positions", "mrope_position_ids"]


# ---------------------------------------------------------------------------- positions from segments
def _count(arg: str, value: Any, minimum: int) -> int:
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_floating_point \
            and value.dtype != torch.bool:
        value = int(value)  # grid entries read from a 0-d integer tensor
    return integer(arg, value, min=minimum, what=f"an integer >= {minimum}")


def check_seconds(arg: str, value: Any) -> Any:
    """A seconds-per-grid value: a finite real >= 0, kept as given (a 0-d tensor keeps its dtype)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.dtype.is_complex:
            fail(arg, "a real number of seconds", value)
        real(arg, float(value), ge=0, what="a finite number of seconds >= 0")
    else:  # a Python float: the reference's product runs in float32
        value = real(arg, value, ge=0, what="a finite number of seconds >= 0")
    return value.reshape(()).cpu() if isinstance(value, torch.Tensor) else value


def check_tokens_per_second(value: Any) -> int | float | None:
    """None (Qwen2-VL) or a finite real > 0 (Qwen2.5-VL's `vision_config.tokens_per_second`)."""
    if value is None:
        return None
    number = real("tokens_per_second", value, gt=0, what="None (Qwen2-VL) or a finite number > 0 (Qwen2.5-VL)")
    return int(value) if isinstance(value, numbers.Integral) else number


def vision_block(
    kind: str, grid: tuple[int, int, int], merge: int, tokens_per_second: Any, second_per_grid: Any
) -> torch.Tensor:
    """`[3, T * H/m * W/m]` int64 positions of one vision block, relative to its start."""
    frames, rows, cols = grid[0], grid[1] // merge, grid[2] // merge
    if tokens_per_second is None:  # Qwen2-VL: temporal index = frame index (images too)
        time = torch.arange(frames)  # [T]
    elif kind == "image":  # Qwen2.5-VL: a still image has no time axis
        time = torch.zeros(frames, dtype=torch.int64)  # [T]
    else:  # Qwen2.5-VL: torch's type promotion decides the dtype of the product, as in the reference
        time = (torch.arange(frames) * second_per_grid * tokens_per_second).long()  # [T], truncated
    shape = (frames, rows, cols)
    t_index = time.view(-1, 1, 1).expand(shape)
    h_index = torch.arange(rows).view(1, -1, 1).expand(shape)
    w_index = torch.arange(cols).view(1, 1, -1).expand(shape)
    return torch.stack((t_index, h_index, w_index)).reshape(3, -1)  # [3, T*rows*cols]


def mrope_segment_positions(
    segments: Sequence[tuple],
    *,
    spatial_merge_size: int = 2,
    tokens_per_second: int | float | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of one sequence described by its segments (no token ids needed).

    Args:
        segments: in order, each one of `("text", n)`, `("image", T, H, W)`, `("video", T, H, W)` or
            `("video", T, H, W, second_per_grid)`; grids in patches before merging, as the processor's
            `image_grid_thw` rows. `second_per_grid` defaults to 1.0 and is used only with
            `tokens_per_second`.
        spatial_merge_size: m, patches merged per side into one LLM token (H and W must be multiples).
        tokens_per_second: None for Qwen2-VL (temporal index = frame index); a number for Qwen2.5-VL.
        start: position of the first token.
    Returns:
        `(positions [3, n_tokens] int64, next_start)`, where `next_start` is the largest position + 1
        (the position of a token appended after the last segment), or `start` when there are no tokens.
    Raises:
        PosencError: an unknown segment kind, non-positive grid sizes, H or W not a multiple of m,
            a negative or non-finite `second_per_grid`.

        >>> pos, nxt = mrope_segment_positions([("video", 3, 2, 2, 0.5)], tokens_per_second=4)
        >>> pos[0].tolist(), nxt
        ([0, 2, 4], 5)
    """
    merge = _count("spatial_merge_size", spatial_merge_size, 1)
    tokens_per_second = check_tokens_per_second(tokens_per_second)
    position = _count("start", start, 0)
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        fail("segments", "a sequence of ('text', n) / ('image', T, H, W) / ('video', T, H, W[, s]) tuples", segments)
    parts = [torch.zeros(3, 0, dtype=torch.int64)]
    for k, segment in enumerate(segments):
        arg = f"segments[{k}]"
        kind = segment[0] if isinstance(segment, (tuple, list)) and segment else None
        if kind == "text" and len(segment) == 2:
            n = _count(arg, segment[1], 0)
            parts.append((torch.arange(n) + position).expand(3, -1))  # [3, n]
            position += n
        elif kind in ("image", "video") and len(segment) in ((4,) if kind == "image" else (4, 5)):
            grid = tuple(_count(arg, size, 1) for size in segment[1:4])
            if grid[1] % merge or grid[2] % merge:
                fail(arg, f"H and W multiples of spatial_merge_size={merge}", tuple(segment))
            seconds = check_seconds(arg, segment[4]) if len(segment) == 5 else 1.0
            block = vision_block(kind, grid, merge, tokens_per_second, seconds) + position  # [3, T*H*W/m^2]
            parts.append(block)
            position = int(block.max()) + 1
        else:
            fail(arg, "('text', n), ('image', T, H, W) or ('video', T, H, W[, second_per_grid])", segment)
    return torch.cat(parts, dim=1), position  # [3, n_tokens]


# ---------------------------------------------------------------------------- positions from token ids
def _grid_rows(arg: str, grids: Any, merge: int) -> list[tuple[int, int, int]]:
    """`[n, 3]` (T, H, W) rows as Python ints, checked."""
    if grids is None:
        return []
    if isinstance(grids, torch.Tensor):
        rows = integer_tensor(arg, grids, what="an integer tensor of shape [n, 3]").tolist()
    else:
        rows = grids
    if not isinstance(rows, (list, tuple)) or any(not isinstance(r, (list, tuple)) or len(r) != 3 for r in rows):
        fail(arg, "an integer tensor or list of shape [n, 3] (T, H, W per row)", grids)
    out = []
    for k, row in enumerate(rows):
        grid = tuple(_count(f"{arg}[{k}]", size, 1) for size in row)
        if grid[1] % merge or grid[2] % merge:
            fail(f"{arg}[{k}]", f"H and W multiples of spatial_merge_size={merge}", list(grid))
        out.append(grid)
    return out


def _seconds_per_video(second_per_grid_ts: Any, n_videos: int, tokens_per_second: Any) -> list[Any]:
    if second_per_grid_ts is None:
        return [1.0] * n_videos  # the reference's default
    # Under Qwen2-VL's rule (tokens_per_second=None) the seconds do not enter the time index (it is the frame
    # index), as in Qwen2-VL's own get_rope_index; they are still checked, so a wrong length is reported.
    if isinstance(second_per_grid_ts, torch.Tensor):
        if second_per_grid_ts.ndim != 1:
            fail("second_per_grid_ts", "a 1-D tensor or list with one entry per video", second_per_grid_ts)
        values = list(second_per_grid_ts.cpu().unbind(0))  # 0-d tensors: keep the dtype the reference sees
    elif isinstance(second_per_grid_ts, (list, tuple)):
        values = list(second_per_grid_ts)
    else:
        fail("second_per_grid_ts", "a 1-D tensor or list with one entry per video", second_per_grid_ts)
    if len(values) != n_videos:
        fail("second_per_grid_ts", f"{n_videos} entries (one per row of video_grid_thw)", f"{len(values)} entries")
    return [check_seconds(f"second_per_grid_ts[{k}]", v) for k, v in enumerate(values)]


def _segments_of_row(
    ids: torch.Tensor, row: int, tokens: dict[str, int], grids: dict[str, list], used: dict[str, int], merge: int
) -> list[tuple]:
    """Split one row of (unpadded) token ids into text runs and vision blocks, consuming grids in order."""
    vision_ids = torch.tensor([tokens["image"], tokens["video"]])
    starts = torch.nonzero((ids[:-1] == tokens["start"]) & torch.isin(ids[1:], vision_ids)).flatten().tolist()
    segments: list[tuple] = []
    text_from = 0
    covered = {"image": 0, "video": 0}
    for j in starts:
        kind = "image" if int(ids[j + 1]) == tokens["image"] else "video"
        arg = f"{kind}_grid_thw"
        k = used[kind]
        if k >= len(grids[kind]):
            fail(arg, f"a row for every {kind} block in input_ids (row {row} has {kind} block {k + 1})",
                 f"{len(grids[kind])} rows")
        grid = grids[kind][k][:3]
        length = grid[0] * (grid[1] // merge) * (grid[2] // merge)
        run = ids[j + 1 : j + 1 + length + 1] == tokens[kind]
        run_length = int(run.long().cumprod(0).sum())  # length of the run of `kind` tokens after vision start
        if run_length != length:
            fail(f"{arg}[{k}]", f"T*H*W/{merge}^2 = {length} {kind} tokens (grid {list(grid)}) to match "
                 f"input_ids row {row} at index {j + 1}", f"{run_length} {kind} tokens there")
        segments += [("text", j + 1 - text_from), (kind, *grids[kind][k])]
        used[kind] += 1
        covered[kind] += length
        text_from = j + 1 + length
    segments.append(("text", ids.numel() - text_from))
    for kind in ("image", "video"):
        total = int((ids == tokens[kind]).sum())
        if total != covered[kind]:
            fail("input_ids", f"every {kind} token inside a block opened by vision_start_token_id "
                 f"(row {row})", f"{total - covered[kind]} {kind} tokens outside such blocks")
    return segments


def mrope_position_ids(
    input_ids: torch.Tensor,
    *,
    image_grid_thw: torch.Tensor | Sequence | None = None,
    video_grid_thw: torch.Tensor | Sequence | None = None,
    second_per_grid_ts: torch.Tensor | Sequence | None = None,
    attention_mask: torch.Tensor | None = None,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int = 2,
    tokens_per_second: int | float | None = None,
    timestamps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE positions for prompts mixing text, images and videos (Qwen2-VL / Qwen2.5-VL `get_rope_index`).

    A vision block is `vision_start_token_id` followed by exactly `T*H*W/m^2` image (or video) tokens;
    blocks take the rows of `image_grid_thw` / `video_grid_thw` in order, across the whole batch.
    Tokens with `attention_mask == 0` are skipped (left or right padding) and get position 1 on every
    axis, as in the reference.

    Args:
        input_ids: `[b, t]` integer token ids.
        image_grid_thw: `[n_images, 3]` (T, H, W) patches per image, in prompt order.
        video_grid_thw: `[n_videos, 3]` (T, H, W) per video.
        second_per_grid_ts: `[n_videos]` seconds per temporal grid step (Qwen2.5-VL only; default 1.0).
        attention_mask: `[b, t]` of 0/1 (or bool); 0 marks padding.
        image_token_id, video_token_id, vision_start_token_id: the tokenizer's ids.
        spatial_merge_size: patches merged per side into one LLM token (`vision_config.spatial_merge_size`).
        tokens_per_second: None for Qwen2-VL (temporal index = frame index); a number
            (`vision_config.tokens_per_second`) for Qwen2.5-VL's `trunc(frame * second_per_grid * tps)`.
        timestamps: Qwen3-VL / Qwen3.5 / Qwen3-VL-MoE: each row (T, H, W) of `video_grid_thw` stands for T
            single-frame blocks (1, H, W), one per timestamped frame in `input_ids`, in order.
    Returns:
        `(position_ids [3, b, t] int64, deltas [b, 1] int64)`, `deltas = max position + 1 - t`: a token
        appended at index i (counting padding) of a row takes position `i + delta` on all three axes.
    Raises:
        PosencError: malformed inputs; grids whose token counts do not match the vision blocks in
            `input_ids` (or more/fewer grid rows than blocks); vision tokens outside a block;
            `second_per_grid_ts` of the wrong length, negative or not finite; `timestamps` with
            `tokens_per_second` or `second_per_grid_ts` (time is in the timestamp text then).

        >>> ids = torch.tensor([[7, 1, 2, 2, 2, 2, 7, 7]])           # text, vision start, 4 image tokens, text
        >>> pos, delta = mrope_position_ids(ids, image_grid_thw=torch.tensor([[1, 4, 4]]),
        ...     image_token_id=2, video_token_id=3, vision_start_token_id=1)
        >>> pos[:, 0].tolist(), delta.tolist()
        ([[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]], [[-2]])
    """
    device = input_ids.device if isinstance(input_ids, torch.Tensor) else None
    input_ids = integer_tensor("input_ids", input_ids, ndim=(2,), what="an integer tensor of shape [b, t]")
    batch, length = input_ids.shape
    if attention_mask is None:
        keep = torch.ones(batch, length, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            fail("attention_mask", f"a tensor of shape {tuple(input_ids.shape)} (as input_ids)", attention_mask)
        if attention_mask.dtype.is_complex or not bool(
            ((attention_mask == 0) | (attention_mask == 1)).all()
        ):
            fail("attention_mask", "values 0 (padding) or 1 (token)", attention_mask)
        keep = (attention_mask == 1).cpu()
    tokens = {"image": image_token_id, "video": video_token_id, "start": vision_start_token_id}
    for name, value in tokens.items():
        _count(f"{name}_token_id" if name != "start" else "vision_start_token_id", value, 0)
    if len(set(tokens.values())) != 3:
        fail("image_token_id", "three distinct ids for image, video and vision start", tokens)
    merge = _count("spatial_merge_size", spatial_merge_size, 1)
    tokens_per_second = check_tokens_per_second(tokens_per_second)
    grids = {"image": _grid_rows("image_grid_thw", image_grid_thw, merge),
             "video": _grid_rows("video_grid_thw", video_grid_thw, merge)}
    if boolean("timestamps", timestamps):  # Qwen3-VL: one block per timestamped frame, time in the text
        for name, value in (("tokens_per_second", tokens_per_second), ("second_per_grid_ts", second_per_grid_ts)):
            if value is not None:
                fail(name, "None with timestamps=True (Qwen3-VL writes each frame's time as text, not as a "
                     "position)", value)
        grids["video"] = [(1, h, w) for t, h, w in grids["video"] for _ in range(t)]  # T rows of (1, H, W)
    seconds = _seconds_per_video(second_per_grid_ts, len(grids["video"]), tokens_per_second)
    grids["video"] = [(*grid, s) for grid, s in zip(grids["video"], seconds)]

    ids_cpu = input_ids.cpu()
    position_ids = torch.ones(3, batch, length, dtype=torch.int64)  # padding slots hold 1, as in the reference
    deltas = torch.zeros(batch, 1, dtype=torch.int64)
    used = {"image": 0, "video": 0}
    text_only = image_grid_thw is None and video_grid_thw is None
    for row in range(batch):
        ids = ids_cpu[row][keep[row]]  # [t_row] unpadded
        segments = _segments_of_row(ids, row, tokens, grids, used, merge)
        positions, next_start = mrope_segment_positions(
            segments, spatial_merge_size=merge, tokens_per_second=tokens_per_second
        )  # [3, t_row]
        position_ids[:, row, keep[row]] = positions
        if text_only or ids.numel() == 0:
            # the reference's text path takes the max over the whole row, padding's 1 included
            next_start = int(position_ids[:, row].max()) + 1 if length else 0
        deltas[row, 0] = next_start - length
    for kind in ("image", "video"):
        if used[kind] != len(grids[kind]):
            fail(f"{kind}_grid_thw", f"{used[kind]} rows (one per {kind} block in input_ids)", f"{len(grids[kind])} rows")
    return position_ids.to(device), deltas.to(device)
