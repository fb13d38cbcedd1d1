"""Sectioned (Qwen2-VL) and interleaved (Qwen3-VL) assembly of M-RoPE cos/sin from three position axes.

Oracles: transformers' own rotary classes (Qwen2-VL, Qwen3-VL), a float64 loop over frequencies
with explicit 2x2 rotations, and the 1-D Rope for text-only positions.
"""

import pytest
import torch

import posenc
from posenc import PosencError
from posenc.rope.mrope import mrope_axis_map, mrope_cos_sin
from posenc.rope.mrope_positions import mrope_position_ids
from posenc.rope.scaling import default_inv_freq

from tests.helpers.tolerances import assert_close
from tests.helpers.oracles import rotate_angles

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl  # noqa: E402
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl  # noqa: E402
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig  # noqa: E402

IMG, VID, VS, VE = 151655, 151656, 151652, 151653


def _multimodal_positions():
    """[3, 2, 30] positions of a real mixed prompt (rows differ), left-padded second row."""
    block = lambda tok, n: [VS] + [tok] * n + [VE]  # noqa: E731
    row0 = [5] + block(IMG, 6) + [6, 7] + block(VID, 8) + [8] * 9
    row1 = [0] * 8 + [5, 6] + block(VID, 12) + [7] * 6
    mask = torch.tensor([[1] * 30, [0] * 8 + [1] * 22])
    pos, _ = mrope_position_ids(
        torch.tensor([row0, row1]), image_grid_thw=[[1, 4, 6]], video_grid_thw=[[2, 4, 4], [3, 2, 8]],
        second_per_grid_ts=torch.tensor([1.3, 0.5]), tokens_per_second=25, attention_mask=mask,
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS,
    )
    return pos


def _loop_reference(x, pos3, inv_freq, axis_of):
    """float64 per-token, per-frequency 2x2 rotation of the split-half pairs (i, i + r/2), angles from the axis map."""
    b, h, t, d = x.shape
    half = inv_freq.numel()
    angles = torch.zeros(b, 1, t, half)  # [b, 1, t, r/2]: the checkpoint convention, float32(p) * inv_freq
    for bi in range(b):
        for ti in range(t):
            for j in range(half):
                angles[bi, 0, ti, j] = pos3[axis_of(j), bi, ti].float() * inv_freq[j].float()
    return rotate_angles(x, angles)  # cos and sin of those angles in float64


def test_sectioned_matches_transformers_qwen2_vl():
    pos = _multimodal_positions()  # [3, 2, 30]
    config = Qwen2VLTextConfig(
        hidden_size=256, num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 30, 128, generator=gen), torch.randn(2, 1, 30, 128, generator=gen)
    cos, sin = qwen2_vl.Qwen2VLRotaryEmbedding(config)(q, pos)  # [2, 30, 128]
    want_q, want_k = qwen2_vl.apply_rotary_pos_emb(q, k, cos, sin)
    rope = posenc.Rope(head_dim=128, base=1e6, mrope_section=(16, 24, 24))
    got_q, got_k = rope.apply(q, k, pos)
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)
    got_cos, got_sin = rope.cos_sin(pos)  # [2, 30, 64] per pair
    assert torch.equal(got_cos, cos[..., :64]) and torch.equal(got_sin, sin[..., :64])


def test_interleaved_matches_transformers_qwen3_vl():
    pos = _multimodal_positions()
    config = Qwen3VLTextConfig(
        hidden_size=256, num_attention_heads=2, head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    )
    q = torch.randn(2, 3, 30, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    cos, sin = qwen3_vl.Qwen3VLTextRotaryEmbedding(config)(q.float(), pos)  # [2, 30, 128] float32
    want, _ = qwen3_vl.apply_rotary_pos_emb(q.float(), q.float(), cos, sin)
    rope = posenc.Rope(head_dim=128, base=5e6, mrope_section=(24, 20, 20), mrope_interleaved=True)
    got_cos, got_sin = rope.cos_sin(pos)
    assert torch.equal(got_cos, cos[..., :64]) and torch.equal(got_sin, sin[..., :64])
    assert_close(rope.rotate(q.float(), pos), want)
    assert_close(rope.rotate(q, pos), want.to(torch.bfloat16), dtype=torch.bfloat16)  # returns q's dtype


@pytest.mark.parametrize("interleaved, sections", [(False, (3, 7, 8)), (True, (6, 6, 6)), (False, (2, 2, 4, 4, 6))])
def test_odd_shapes_against_loop_rotation(interleaved, sections, gen):
    half = sum(sections)  # 18 pairs -> head_dim 36 (+ 6 pass-through channels), 5 sections wrap around axes
    pos = torch.randint(0, 300, (3, 3, 7), generator=gen)
    x = torch.randn(3, 5, 7, 2 * half + 6, generator=gen)
    inv = default_inv_freq(1e4, 2 * half)
    rope = posenc.Rope(head_dim=2 * half + 6, rotary_dim=2 * half, mrope_section=sections, mrope_interleaved=interleaved)
    if interleaved:
        def axis_of(j):  # Qwen3-VL rule written out
            if j % 3 == 1 and j < 3 * sections[1]:
                return 1
            if j % 3 == 2 and j < 3 * sections[2]:
                return 2
            return 0
    else:
        owners = [k % 3 for k, s in enumerate(sections) for _ in range(s)]
        axis_of = owners.__getitem__
    want = _loop_reference(x[..., : 2 * half], pos, inv, axis_of)
    got = rope.rotate(x, pos)
    assert_close(got[..., : 2 * half], want.float())
    assert torch.equal(got[..., 2 * half :], x[..., 2 * half :])  # pass-through bit-identical
    cos, sin = mrope_cos_sin(pos, inv, sections, interleaved=interleaved)  # the functional form
    assert_close(posenc.apply_rope(x, cos, sin), got)


@pytest.mark.parametrize("interleaved, sections", [(False, (16, 24, 24)), (True, (24, 20, 20))])
def test_text_only_reduces_exactly_to_1d(interleaved, sections, gen):
    ids = torch.randint(10, 1000, (2, 11), generator=gen)
    pos3, _ = mrope_position_ids(ids, attention_mask=torch.tensor([[1] * 11, [0] * 3 + [1] * 8]),
                                 image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS)
    multi = posenc.Rope(head_dim=128, base=1e6, mrope_section=sections, mrope_interleaved=interleaved)
    plain = posenc.Rope(head_dim=128, base=1e6)
    q = torch.randn(2, 4, 11, 128, generator=gen)
    assert torch.equal(multi.rotate(q, pos3), plain.rotate(q, pos3[0]))
    for a, b in zip(multi.cos_sin(pos3), plain.cos_sin(pos3[0])):
        assert torch.equal(a, b)


def test_axis_map_rules():
    assert mrope_axis_map((16, 24, 24)).tolist() == [0] * 16 + [1] * 24 + [2] * 24
    m = mrope_axis_map((24, 20, 20), interleaved=True).tolist()
    assert m[:60] == [0, 1, 2] * 20 and m[60:] == [0, 0, 0, 0]


def test_bad_input():
    inv = torch.ones(4)
    with pytest.raises(PosencError, match="position_ids: expected shape \\[3, b, t\\] or \\[3, t\\]"):
        mrope_cos_sin(torch.zeros(2, 5, dtype=torch.long), inv, (2, 1, 1))
    with pytest.raises(PosencError, match="position_ids: expected an integer dtype"):
        mrope_cos_sin(torch.zeros(3, 5), inv, (2, 1, 1))
    with pytest.raises(PosencError, match="sections: expected sections summing to r/2 = 4"):
        mrope_cos_sin(torch.zeros(3, 5, dtype=torch.long), inv, (2, 1, 2))
    with pytest.raises(PosencError, match="mrope_section"):
        mrope_cos_sin(torch.zeros(3, 5, dtype=torch.long), inv, (2, -1, 3))
