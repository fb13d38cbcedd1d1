"""Qwen3-VL / Qwen3.5 M-RoPE positions (`mrope_position_ids(..., timestamps=True)`).

Oracles: hand-derived ids; `_closed_form`, the official rule written per token from its statement (a video of
T temporal patches is T timestamped single-frame blocks; a frame block at start s puts merged patch (y, x) at
(s, s + y, s + x) and the next token at s + max(H, W) / m); and transformers 5.24's own
`Qwen3VLModel.get_rope_index` (shared verbatim by qwen3_vl_moe, qwen3_5 and qwen3_5_moe) on random prompts.
"""

import functools
import random
import types

import pytest
import torch

from posenc import PosencError
from posenc.rope.mrope_positions import mrope_position_ids

IMG, VID, VS, VE, PAD = 151655, 151656, 151652, 151653, 151643
IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS)


def _frame(kind, h, w, merge=2):
    return [VS] + [kind] * (h // merge * w // merge) + [VE]


def _video(t, h, w, stamp=900):
    """The processor's layout: a timestamp text token before each frame's block."""
    out = []
    for f in range(t):
        out += [stamp + f] + _frame(VID, h, w)
    return out


def _closed_form(tokens, images, videos, merge=2):
    """Positions of one unpadded row from the official rule's statement (no posenc code)."""
    queue = {"image": list(images), "video": [(1, h, w) for t, h, w in videos for _ in range(t)]}
    out, s, i = [], 0, 0
    while i < len(tokens):
        if tokens[i] in (IMG, VID):
            t, h, w = queue["image" if tokens[i] == IMG else "video"].pop(0)
            for f in range(t):
                for y in range(h // merge):
                    for x in range(w // merge):
                        out.append((s + f, s + y, s + x))
            i += t * (h // merge) * (w // merge)
            s = s + max(t, h // merge, w // merge)  # the largest position + 1
        else:
            out.append((s, s, s))
            s, i = s + 1, i + 1
    return out, s


def test_two_frame_video_hand_checked():
    # text, stamp 0, VS, frame (4x4 patches: 2x2 tokens), VE, stamp 1, VS, frame, VE, text
    ids = torch.tensor([[21] + _video(2, 4, 4) + [22]])
    pos, delta = mrope_position_ids(ids, video_grid_thw=torch.tensor([[2, 4, 4]]), timestamps=True, **IDS)
    assert pos[0, 0].tolist() == [0, 1, 2, 3, 3, 3, 3, 5, 6, 7, 8, 8, 8, 8, 10, 11]
    assert pos[1, 0].tolist() == [0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 8, 8, 9, 9, 10, 11]
    assert pos[2, 0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8, 9, 8, 9, 10, 11]
    assert delta.tolist() == [[12 - 16]]
    # the Qwen2-VL rule on the same grid wants all frames in one block: the timestamped layout is refused
    with pytest.raises(PosencError, match="video_grid_thw\\[0\\]: expected T\\*H\\*W/2\\^2 = 8 video tokens"):
        mrope_position_ids(ids, video_grid_thw=torch.tensor([[2, 4, 4]]), **IDS)


def _random_batch(seed):
    rng = random.Random(seed)
    rows, images, videos = [], [], []
    for _ in range(rng.randint(1, 3)):
        toks = [rng.randint(10, 500) for _ in range(rng.randint(0, 3))]
        for _ in range(rng.randint(0, 3)):
            h, w = 2 * rng.randint(1, 4), 2 * rng.randint(1, 5)
            if rng.random() < 0.5:
                images.append([1, h, w])
                toks += _frame(IMG, h, w)
            else:
                t = rng.randint(1, 4)
                videos.append([t, h, w])
                toks += _video(t, h, w)
            toks += [rng.randint(10, 500) for _ in range(rng.randint(0, 3))]
        rows.append(toks + [rng.randint(10, 500)])
    length = max(map(len, rows)) + rng.randint(0, 3)
    left = rng.random() < 0.6
    pad = [length - len(r) for r in rows]
    ids = [[PAD] * p + r if left else r + [PAD] * p for r, p in zip(rows, pad)]
    mask = [[0] * p + [1] * len(r) if left else [1] * len(r) + [0] * p for r, p in zip(rows, pad)]
    return ids, mask, images, videos


@pytest.mark.parametrize("seed", range(40))
def test_random_prompts_match_the_closed_form(seed):
    ids, mask, images, videos = _random_batch(seed)
    pos, delta = mrope_position_ids(
        torch.tensor(ids), image_grid_thw=images or None, video_grid_thw=videos or None,
        attention_mask=torch.tensor(mask), timestamps=True, **IDS)
    img_k = vid_k = 0
    for row, (r, m) in enumerate(zip(ids, mask)):
        kept = [tok for tok, keep in zip(r, m) if keep]
        n_img = sum(tok == VS and nxt == IMG for tok, nxt in zip(kept, kept[1:]))
        vid_rows = []
        frames = sum(tok == VS and nxt == VID for tok, nxt in zip(kept, kept[1:]))
        while frames:
            vid_rows.append(videos[vid_k])
            frames -= videos[vid_k][0]
            vid_k += 1
        want, nxt = _closed_form(kept, images[img_k:img_k + n_img], vid_rows)
        img_k += n_img
        keep = torch.tensor(m, dtype=torch.bool)
        assert pos[:, row, keep].T.tolist() == [list(p) for p in want], (seed, row)
        assert (pos[:, row, ~keep] == 1).all()  # padding slots hold 1 (the official rule)
        if not images and not videos:  # the official text-only path: the max over the row, padding's 1 included
            nxt = max(nxt, 2 if len(kept) < len(r) else 0)
        assert int(delta[row]) == nxt - len(r)  # counting padding (the official rule)


def _transformers_rope_index():
    qwen3_vl = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    model = qwen3_vl.Qwen3VLModel
    owner = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2)),
        get_vision_position_ids=functools.partial(model.get_vision_position_ids, None))  # uses no state
    return functools.partial(model.get_rope_index, owner)


@pytest.mark.parametrize("seed", range(40))
def test_random_prompts_match_transformers(seed):
    """transformers 5.24 agrees on every real token; it pads with 0 and counts deltas from the real tokens."""
    get_rope_index = _transformers_rope_index()
    ids, mask, images, videos = _random_batch(seed)
    ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
    kinds = (ids_t == IMG).int() + 2 * (ids_t == VID).int()  # the processor's mm_token_type_ids
    grids = dict(image_grid_thw=torch.tensor(images) if images else None,
                 video_grid_thw=torch.tensor(videos) if videos else None)
    theirs, their_delta = get_rope_index(ids_t, kinds, attention_mask=mask_t, **grids)
    ours, delta = mrope_position_ids(ids_t, attention_mask=mask_t, timestamps=True, **grids, **IDS)
    keep = mask_t.bool()
    assert torch.equal(ours[:, keep], theirs[:, keep])
    assert (theirs[:, ~keep] == 0).all() and (ours[:, ~keep] == 1).all()
    if images or videos:
        assert torch.equal(their_delta, delta + (~keep).sum(-1, keepdim=True))
    else:  # text only (transformers never calls it so): its deltas are 0, the official ones see padding's 1
        assert not their_delta.any()


def test_where_transformers_diverges_from_the_official_rule():
    """An image grid with T > 1 (the Qwen3-VL image processor makes T = 1; a caller can pass more): the official
    rule continues after the block's largest position, transformers 5.24 at start + max(H, W) / m."""
    get_rope_index = _transformers_rope_index()
    ids = torch.tensor([[21] + [VS] + [IMG] * 3 + [VE, 22]])  # image (3, 2, 2): 3 temporal patches of 1 token
    grid = torch.tensor([[3, 2, 2]])
    ours, _ = mrope_position_ids(ids, image_grid_thw=grid, timestamps=True, **IDS)
    theirs, _ = get_rope_index(ids, (ids == IMG).int(), image_grid_thw=grid)
    assert ours[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert theirs[0, 0].tolist() == [0, 1, 2, 3, 4, 3, 4]  # VE lands on the image's own T positions


@pytest.mark.parametrize("kw, match", [
    (dict(tokens_per_second=2), "tokens_per_second: expected None with timestamps=True"),
    (dict(second_per_grid_ts=[0.5]), "second_per_grid_ts: expected None with timestamps=True"),
    (dict(timestamps=1), "timestamps: expected True or False"),
    (dict(video_grid_thw=[[3, 4, 4]]), "video_grid_thw: expected 2 rows .*got '3 rows"),
])
def test_bad_input(kw, match):
    ids = torch.tensor([_video(2, 4, 4)])
    with pytest.raises(PosencError, match=match):
        mrope_position_ids(ids, **{"video_grid_thw": [[2, 4, 4]], "timestamps": True, **kw}, **IDS)
