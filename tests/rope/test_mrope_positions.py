"""M-RoPE position builder (Qwen2-VL / Qwen2.5-VL `get_rope_index` semantics).

Oracles: hand-computed ids for small prompts, and `_oracle`, a token-by-token transcription of the
official rules (transformers 4.49-4.51 `get_rope_index`) written independently of posenc, with the
Qwen2.5-VL time product done in numpy float32 (the processor's dtype for second_per_grid_ts).
"""

import random

import numpy as np
import pytest
import torch

from posenc import PosencError
from posenc.rope.mrope_positions import mrope_position_ids, mrope_segment_positions

IMG, VID, VS, VE, PAD = 151655, 151656, 151652, 151653, 151643
IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS)


def _oracle(input_ids, mask, images, videos, seconds, tps, merge=2):
    """Per sample, per token: text advances by one; a block places (f, y, x) at start + (time, y, x)."""
    b, t = len(input_ids), len(input_ids[0])
    out = [[[1] * t for _ in range(b)] for _ in range(3)]  # padded slots hold 1
    videos_with_seconds = list(zip(videos or [], seconds or [None] * len(videos or [])))
    deltas, queue = [], {IMG: list(images or []), VID: videos_with_seconds}
    for row in range(b):
        kept = [i for i in range(t) if mask is None or mask[row][i] == 1]
        toks = [input_ids[row][i] for i in kept]
        coords, nxt, i = [], 0, 0
        while i < len(toks):
            if toks[i] in (IMG, VID) and images is None and videos is None:
                raise AssertionError("test prompt has vision tokens but no grids")
            if toks[i] in (IMG, VID):
                kind = toks[i]
                (gt, gh, gw), sec = (queue[kind].pop(0), None) if kind == IMG else queue[kind].pop(0)
                block = []
                for f in range(gt):
                    if tps is None:
                        time = f
                    elif kind == IMG:
                        time = 0
                    else:
                        time = int(np.float32(f) * np.float32(sec) * np.float32(tps))
                    for y in range(gh // merge):
                        for x in range(gw // merge):
                            block.append((nxt + time, nxt + y, nxt + x))
                coords += block
                nxt = max(max(c) for c in block) + 1
                i += len(block)
            else:
                coords.append((nxt, nxt, nxt))
                nxt += 1
                i += 1
        for slot, c in zip(kept, coords):
            for axis in range(3):
                out[axis][row][slot] = c[axis]
        if images is None and videos is None:  # text path: max over the row, padding's 1 included
            nxt = max(max(out[0][row]), 1 if len(kept) < t else 0) + 1
        deltas.append([nxt - t])
    return torch.tensor(out), torch.tensor(deltas)


def _tokens(kind, grid, merge=2):
    return [VS] + [kind] * (grid[0] * grid[1] * grid[2] // merge // merge) + [VE]


# ------------------------------------------------------------------------------- hand-checked ids
# Prompt: T <img (1,4,4)> T <img (1,2,4)> <vid (3,2,2)> T, merge 2  (18 tokens)
#   0 T | 1 VS | image 2x2 at start 2 | VE | T | VS | image 1x2 at 7 | VE | VS | video 3 frames of 1x1 at 11 | VE | T
PROMPT = [21] + _tokens(IMG, (1, 4, 4)) + [22] + _tokens(IMG, (1, 2, 4)) + _tokens(VID, (3, 2, 2)) + [23]
GRIDS = dict(image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 4]]), video_grid_thw=torch.tensor([[3, 2, 2]]))
HEAD = [0, 1, 2, 2, 2, 2, 4, 5, 6, 7, 7, 9, 10]  # T row up to the vision start of the video
H_HEAD = [0, 1, 2, 2, 3, 3, 4, 5, 6, 7, 7, 9, 10]
W_HEAD = [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize(
    "tps, seconds, t_video, after",
    [
        (None, None, [11, 12, 13], 14),  # Qwen2-VL: frame index
        (2, [0.5], [11, 12, 13], 14),  # f * 0.5 * 2 = f
        (25, [0.5], [11, 23, 36], 37),  # f * 12.5 -> 0, 12, 25
        (2, [1.3], [11, 13, 16], 17),  # f * 2.6 -> 0, 2, 5
        (25, [2.0], [11, 61, 111], 112),  # f * 50
    ],
)
def test_two_images_and_a_video_hand_checked(tps, seconds, t_video, after):
    sec = None if seconds is None else torch.tensor(seconds)
    pos, delta = mrope_position_ids(
        torch.tensor([PROMPT]), **GRIDS, second_per_grid_ts=sec, tokens_per_second=tps, **IDS
    )
    assert pos.shape == (3, 1, 18) and pos.dtype == torch.int64
    assert pos[0, 0].tolist() == HEAD + t_video + [after, after + 1]
    assert pos[1, 0].tolist() == H_HEAD + [11, 11, 11] + [after, after + 1]
    assert pos[2, 0].tolist() == W_HEAD + [11, 11, 11] + [after, after + 1]
    assert delta.tolist() == [[after + 2 - 18]]


def test_left_padding_hand_checked():
    row0 = [21] + _tokens(IMG, (1, 4, 4)) + [22]  # 8 tokens
    row1 = [PAD] * 3 + [21] + _tokens(IMG, (1, 2, 4))  # 3 pads + 5 tokens
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    grids = torch.tensor([[1, 4, 4], [1, 2, 4]])  # consumed in batch order
    pos, delta = mrope_position_ids(torch.tensor([row0, row1]), image_grid_thw=grids, attention_mask=mask, **IDS)
    assert pos[:, 0].tolist() == [[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]]
    assert pos[:, 1].tolist() == [[1, 1, 1, 0, 1, 2, 2, 4], [1, 1, 1, 0, 1, 2, 2, 4], [1, 1, 1, 0, 1, 2, 3, 4]]
    assert delta.tolist() == [[6 - 8], [5 - 8]]


def test_text_after_long_video_continues_after_its_time_axis():
    # video (4, 2, 2): 4 frames of one token at start 2 -> T = 2..5, H = W = 2; text continues at 6
    ids = torch.tensor([[21] + _tokens(VID, (4, 2, 2)) + [22]])
    pos, delta = mrope_position_ids(ids, video_grid_thw=torch.tensor([[4, 2, 2]]), **IDS)
    assert pos[:, 0].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 2, 2, 2, 6, 7], [0, 1, 2, 2, 2, 2, 6, 7]]
    assert delta.tolist() == [[0]]


def test_still_image_time_is_constant_under_qwen25():
    ids = torch.tensor([_tokens(IMG, (2, 2, 2))])  # an image with two temporal patches
    q25, _ = mrope_position_ids(ids, image_grid_thw=[[2, 2, 2]], tokens_per_second=25, **IDS)
    q2, _ = mrope_position_ids(ids, image_grid_thw=[[2, 2, 2]], **IDS)
    assert q25[0, 0].tolist() == [0, 1, 1, 2] and q2[0, 0].tolist() == [0, 1, 2, 3]


def test_text_only_is_one_d():
    ids = torch.randint(10, 500, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 9, [0] * 4 + [1] * 5, [0] * 8 + [1]])
    pos, delta = mrope_position_ids(ids, attention_mask=mask, **IDS)
    assert torch.equal(pos[0], pos[1]) and torch.equal(pos[1], pos[2])
    assert pos[0].tolist() == [list(range(9)), [1] * 4 + list(range(5)), [1] * 8 + [0]]
    assert delta.flatten().tolist() == [0, -4, -7]  # max over the row (padding's 1 included) + 1 - 9
    pos, delta = mrope_position_ids(ids, **IDS)
    assert torch.equal(pos, torch.arange(9).expand(3, 3, 9)) and delta.flatten().tolist() == [0, 0, 0]


# ------------------------------------------------------------------------------- random prompts vs the oracle
def _random_batch(seed):
    rng = random.Random(seed)
    rows, images, videos, seconds = [], [], [], []
    for _ in range(rng.randint(1, 4)):
        toks = []
        for _ in range(rng.randint(0, 4)):
            toks += [rng.randint(10, 500) for _ in range(rng.randint(0, 4))]
            kind = rng.choice(["text", IMG, VID])
            if kind == "text":
                continue
            grid = [rng.randint(1, 2) if kind == IMG else rng.randint(1, 6), 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)]
            (images if kind == IMG else videos).append(grid)
            if kind == VID:
                seconds.append(rng.choice([0.5, 1.3, 2.0, 0.25, 1 / 3, 0.7, 0.083, 2.6]))
            toks += _tokens(kind, grid)[: None if rng.random() < 0.8 else -1]  # sometimes no vision end
        rows.append(toks + [rng.randint(10, 500) for _ in range(rng.randint(1, 3))])
    t = max(map(len, rows)) + rng.randint(0, 2)
    left = rng.random() < 0.7
    ids = [[PAD] * (t - len(r)) + r if left else r + [PAD] * (t - len(r)) for r in rows]
    mask = [[0] * (t - len(r)) + [1] * len(r) if left else [1] * len(r) + [0] * (t - len(r)) for r in rows]
    return ids, mask, images or None, videos or None, seconds, rng.choice([2, 25, 4])


@pytest.mark.parametrize("seed", range(120))
def test_random_prompts_match_oracle(seed):
    ids, mask, images, videos, seconds, tps = _random_batch(seed)
    grids = dict(
        image_grid_thw=None if images is None else torch.tensor(images),
        video_grid_thw=None if videos is None else torch.tensor(videos),
        attention_mask=torch.tensor(mask),
    )
    for rule_tps in (None, tps):
        sec = torch.tensor(seconds, dtype=torch.float32) if rule_tps and videos else None
        pos, delta = mrope_position_ids(torch.tensor(ids), **grids, second_per_grid_ts=sec, tokens_per_second=rule_tps, **IDS)
        want_pos, want_delta = _oracle(ids, mask, images, videos, seconds if rule_tps else [], rule_tps)
        assert torch.equal(pos, want_pos), (seed, rule_tps)
        assert torch.equal(delta, want_delta), (seed, rule_tps)


@pytest.mark.parametrize("seed", range(20))
def test_each_row_equals_its_solo_run_and_segments(seed):
    ids, mask, images, videos, seconds, tps = _random_batch(seed)
    sec = torch.tensor(seconds) if videos else None
    pos, delta = mrope_position_ids(
        torch.tensor(ids), image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=sec,
        attention_mask=torch.tensor(mask), tokens_per_second=tps, **IDS,
    )
    img_k = vid_k = 0
    for row, (r, m) in enumerate(zip(ids, mask)):
        kept = [tok for tok, keep in zip(r, m) if keep]
        segments, i = [], 0
        while i < len(kept):
            if kept[i] in (IMG, VID):
                if kept[i] == IMG:
                    grid, img_k = images[img_k], img_k + 1
                    segments.append(("image", *grid))
                else:
                    grid, vid_k = videos[vid_k], vid_k + 1
                    segments.append(("video", *grid, sec[vid_k - 1]))
                i += grid[0] * grid[1] * grid[2] // 4
            else:
                segments.append(("text", 1))
                i += 1
        want, nxt = mrope_segment_positions(segments, tokens_per_second=tps)
        keep = torch.tensor(m, dtype=torch.bool)
        assert torch.equal(pos[:, row, keep], want)
        assert int(delta[row]) == nxt - len(r)


def test_segment_start_offsets_every_position():
    segments = [("text", 3), ("video", 2, 4, 2, 0.5), ("image", 1, 2, 2), ("text", 2)]
    base, nxt = mrope_segment_positions(segments, tokens_per_second=2)
    shifted, nxt2 = mrope_segment_positions(segments, tokens_per_second=2, start=100)
    assert torch.equal(shifted, base + 100) and nxt2 == nxt + 100
    assert mrope_segment_positions([])[0].shape == (3, 0)


# ------------------------------------------------------------------------------- bad input
def _call(**kw):
    base = dict(image_grid_thw=torch.tensor([[1, 4, 4]]), **IDS)
    ids = kw.pop("ids", torch.tensor([[21] + _tokens(IMG, (1, 4, 4))]))
    return mrope_position_ids(ids, **{**base, **kw})


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(image_grid_thw=torch.tensor([[1, 2, 4]])), "image_grid_thw\\[0\\]: expected T\\*H\\*W/2\\^2 = 2"),
        (dict(image_grid_thw=torch.tensor([[1, 4, 6]])), "= 6 image tokens .*got '4 image tokens"),
        (dict(image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 2]])), "image_grid_thw: expected 1 rows"),
        (dict(image_grid_thw=None), "image_grid_thw: expected a row for every image block"),
        (dict(image_grid_thw=torch.tensor([[1, 3, 4]])), "multiples of spatial_merge_size=2"),
        (dict(image_grid_thw=torch.tensor([[1.0, 4.0, 4.0]])), "image_grid_thw: expected an integer tensor"),
        (dict(ids=torch.tensor([[21, IMG, IMG, IMG, IMG]])), "input_ids: expected every image token inside a block"),
        (dict(ids=torch.tensor([21, 22])), "input_ids: expected an integer tensor of shape \\[b, t\\]"),
        (dict(attention_mask=torch.full((1, 7), 2)), "attention_mask: expected values 0 \\(padding\\) or 1"),
        (dict(attention_mask=torch.ones(1, 5, dtype=torch.long)), "attention_mask: expected a tensor of shape"),
        (dict(tokens_per_second=0), "tokens_per_second: expected None"),
        (dict(spatial_merge_size=0), "spatial_merge_size: expected an integer >= 1"),
        (dict(video_token_id=IMG), "three distinct ids"),
    ],
)
def test_bad_input(kw, match):
    with pytest.raises(PosencError, match=match):
        _call(**kw)


@pytest.mark.parametrize(
    "seconds, tps, match",
    [
        (torch.tensor([0.5, 1.0]), 2, "second_per_grid_ts: expected 1 entries.*got '2 entries"),
        (torch.tensor([]), 2, "second_per_grid_ts: expected 1 entries.*got '0 entries"),
        (torch.tensor([0.5, 1.0]), None, "second_per_grid_ts: expected 1 entries.*got '2 entries"),
        ([-0.5], 2, "second_per_grid_ts\\[0\\]: expected a finite number of seconds >= 0"),
        ([float("nan")], 2, "finite number of seconds"),
        (torch.tensor([[0.5]]), 2, "a 1-D tensor or list"),
    ],
)
def test_bad_second_per_grid_ts(seconds, tps, match):
    ids = torch.tensor([_tokens(VID, (2, 2, 2))])
    with pytest.raises(PosencError, match=match):
        mrope_position_ids(ids, video_grid_thw=[[2, 2, 2]], second_per_grid_ts=seconds, tokens_per_second=tps, **IDS)


def test_seconds_do_not_enter_qwen2_vl_rule():
    """Qwen2-VL's time index is the frame index: seconds per grid are checked but do not change it."""
    ids = torch.tensor([[11] + _tokens(VID, (3, 2, 2)) + [12]])
    plain, d0 = mrope_position_ids(ids, video_grid_thw=[[3, 2, 2]], **IDS)
    timed, d1 = mrope_position_ids(ids, video_grid_thw=[[3, 2, 2]], second_per_grid_ts=[0.5], **IDS)
    assert torch.equal(plain, timed) and torch.equal(d0, d1)
    assert plain[0, 0, 2:5].tolist() == [2, 3, 4]  # text at 0, vision start at 1, frames 0..2 from 2


@pytest.mark.parametrize("segment", [("audio", 3), ("text", -1), ("image", 1, 3, 4), ("video", 0, 2, 2), ("text",)])
def test_bad_segments(segment):
    with pytest.raises(PosencError, match="segments\\[0\\]"):
        mrope_segment_positions([segment])
