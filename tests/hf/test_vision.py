"""Vision towers' axial RoPE (`posenc.rope.axial.AxialRope`, `posenc.hf.vision_rope`) against transformers'
vision rotary classes, its patch positions and apply function, and the 2x2 oracle. Every tower of the pinned
transformers is compared by tests/hf/test_enumeration.py.
"""

import pytest
import torch
from tests.helpers.tolerances import assert_close
from tests.helpers.oracles import rotate_angles

import posenc.hf
from posenc import PosencError
from posenc.rope.axial import AxialRope, vision_patch_positions

transformers = pytest.importorskip("transformers")

GRIDS = torch.tensor([[1, 6, 10], [2, 4, 2]])  # (T, H, W) patches: an image and a two-frame video


def test_qwen2_vl_tower_matches_transformers_bit_for_bit():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m
    from transformers.vision_utils import get_vision_position_ids

    config = transformers.AutoConfig.for_model("qwen2_vl_vision", embed_dim=240, num_heads=3)  # head_dim 80
    rope = posenc.hf.vision_rope(config)
    assert rope == posenc.hf.vision_rope(config.to_dict()) == AxialRope(80, 10000.0)
    pos = vision_patch_positions(GRIDS, spatial_merge_size=2)  # [76, 2]
    assert torch.equal(pos, get_vision_position_ids(GRIDS, 2))  # the tower's own patch order
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(len(pos), 3, 80, generator=gen), torch.randn(len(pos), 3, 80, generator=gen)
    cos, sin = m.Qwen2VLVisionRotaryEmbedding(config)(q, pos)
    want = m.apply_rotary_pos_emb_vision(q, k, cos, sin)
    assert torch.equal(rope.rotate(q, pos), want[0]) and torch.equal(rope.rotate(k, pos), want[1])


@pytest.mark.parametrize("order, pairing", [((0, 1), "split_half"), ((1, 0), "split_half"), ((1, 0), "interleaved"),
                                            ((0, 1), "interleaved")])
def test_axial_layouts_against_the_2x2_oracle(order, pairing):
    gen = torch.Generator().manual_seed(1)
    rope = AxialRope(head_dim=24, base=100.0, axis_order=order, pairing=pairing)
    pos = torch.randint(0, 50, (13, 2), generator=gen)  # [patches, (row, column)]
    x = torch.randn(13, 2, 24, generator=gen)  # [patches, h, d]
    inv = 1.0 / 100.0 ** (torch.arange(0, 12, 2, dtype=torch.float64) / 12)  # [6] per axis, float64
    angles = torch.cat([pos[:, a, None].double() * inv for a in order], -1)  # [13, 12]: one block per axis
    want = rotate_angles(x, angles[:, None, :], pairing)
    assert_close(rope.rotate(x, pos).double(), want, torch.float32)


def test_refused_towers_name_what_posenc_does_not_model():
    with pytest.raises(PosencError, match="got 'pixtral', which applies one ladder over the whole head"):
        posenc.hf.vision_rope(transformers.AutoConfig.for_model("pixtral"))
    with pytest.raises(PosencError, match=r"rope_type'\]: expected 'axial' in the config or its vision_config"):
        posenc.hf.vision_rope({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=10), "head_dim: expected a positive multiple of 2 \\* 2 axes"),
    (dict(head_dim=8, axis_order=(0, 0)), "axis_order: expected a permutation"),
    (dict(head_dim=8, pairing="interleaved_to_split_half"), "pairing: expected one of"),
    (dict(head_dim=8, base=-1.0), "base"),
])
def test_bad_axial_rope(kw, match):
    with pytest.raises(PosencError, match=match):
        AxialRope(**kw)


def test_bad_axial_positions():
    with pytest.raises(PosencError, match="positions: expected an integer tensor \\[..., 2\\]"):
        AxialRope(8).cos_sin(torch.zeros(5, 3, dtype=torch.long))
