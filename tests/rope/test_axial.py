"""2-D axial RoPE for vision patches (Qwen2-VL vision encoder).

Oracles: transformers' `get_vision_position_ids`, `Qwen2VLVisionRotaryEmbedding` and
`apply_rotary_pos_emb_vision`; hand-written patch orders; float64 2x2 rotations per pair.
"""


import pytest
import torch

import posenc
from posenc import PosencError
from posenc.rope.axial import axial_cos_sin, vision_patch_positions

from tests.helpers.tolerances import assert_close
from tests.helpers.oracles import rotate_angles

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl  # noqa: E402
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.vision_utils import get_vision_position_ids  # noqa: E402

GRIDS = torch.tensor([[1, 4, 6], [2, 2, 4], [1, 6, 2]])  # an image, a 2-frame video, a tall image


def test_patch_order_hand_checked():
    # H=2, W=4, m=2: window (0,0) holds (0,0),(0,1),(1,0),(1,1); window (0,1) holds (0,2),(0,3),(1,2),(1,3)
    pos = vision_patch_positions([[2, 2, 4]], spatial_merge_size=2)
    frame = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert [tuple(p) for p in pos.tolist()] == frame * 2  # repeated per frame
    assert vision_patch_positions([[1, 2, 3]], spatial_merge_size=1).tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_patch_order_matches_transformers():
    assert torch.equal(vision_patch_positions(GRIDS, 2), get_vision_position_ids(GRIDS, 2))


@pytest.mark.parametrize("head_dim, heads", [(16, 4), (40, 3)])
def test_vision_rotary_matches_transformers(head_dim, heads, gen):
    config = Qwen2VLVisionConfig(embed_dim=head_dim * heads, num_heads=heads)
    positions = vision_patch_positions(GRIDS, 2)  # [n, 2]
    n = positions.shape[0]
    want_cos, want_sin = qwen2_vl.Qwen2VLVisionRotaryEmbedding(config)(torch.zeros(1), positions)  # [n, head_dim]
    cos, sin = axial_cos_sin(positions, head_dim=head_dim, base=10000.0)  # [n, head_dim/2]
    assert torch.equal(cos, want_cos[:, : head_dim // 2]) and torch.equal(sin, want_sin[:, : head_dim // 2])
    q = torch.randn(n, heads, head_dim, generator=gen)
    k = torch.randn(n, heads, head_dim, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    want_q, want_k = qwen2_vl.apply_rotary_pos_emb_vision(q, k, want_cos, want_sin)
    assert_close(posenc.apply_rope(q, cos, sin, layout="thd"), want_q)
    assert_close(posenc.apply_rope(k, cos, sin, layout="thd"), want_k, dtype=torch.bfloat16)


def test_rotation_pairs_against_explicit_2x2(gen):
    head_dim = 12  # 3 pairs for rows, 3 pairs for columns
    positions = torch.tensor([[0, 0], [3, 1], [7, 11], [2, 5], [0, 9]])  # odd count, arbitrary order
    x = torch.randn(5, 2, head_dim, generator=gen, dtype=torch.float64)
    cos, sin = axial_cos_sin(positions, head_dim)
    got = posenc.apply_rope(x, cos.double(), sin.double(), layout="thd")
    half = head_dim // 2
    angles = torch.zeros(len(positions), 1, half, dtype=torch.float64)  # [t, 1, pairs]
    for i, (row, col) in enumerate(positions.tolist()):
        for j in range(half):
            axis_pos, f = (row, j) if j < half // 2 else (col, j - half // 2)
            angles[i, 0, j] = axis_pos * 10000.0 ** (-2 * f / half)  # per-axis width head_dim/2
    want = rotate_angles(x, angles)  # [t, heads, head_dim], split-half pairs (j, j + half)
    # float32 tolerance: the table's angles are float32 (as the checkpoint), the oracle's float64
    assert_close(got.float(), want.float())


def test_three_axes_and_exact_precision():
    positions = torch.tensor([[[1, 2, 3]], [[40, 50, 60]]])  # [2, 1, a=3]
    cos, sin = axial_cos_sin(positions, head_dim=24, precision="exact")  # [2, 1, 12]
    inv = torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)], dtype=torch.float32).double()
    want = (positions.double()[..., None] * inv).flatten(-2)  # [2, 1, 12] float64 angles of the fp32 frequencies
    assert_close(cos, torch.cos(want).float())
    assert_close(sin, torch.sin(want).float())


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: vision_patch_positions([[1, 3, 4]]), "grid_thw\\[0\\]: expected H and W multiples"),
        (lambda: vision_patch_positions([[0, 2, 2]]), "grid_thw\\[0\\]: expected positive integers"),
        (lambda: vision_patch_positions(torch.ones(2, 3)), "grid_thw: expected an integer tensor"),
        (lambda: vision_patch_positions([[1, 2]]), "grid_thw: expected an integer tensor or list of shape \\[n, 3\\]"),
        (lambda: vision_patch_positions([[1, 2, 2]], spatial_merge_size=0), "spatial_merge_size"),
        (lambda: axial_cos_sin(torch.tensor([[1, 2]]), head_dim=10), "head_dim: expected a positive multiple of 2 \\* 2"),
        (lambda: axial_cos_sin(torch.tensor([[1.0, 2.0]]), head_dim=8), "positions: expected an integer dtype"),
        (lambda: axial_cos_sin(torch.tensor([[-1, 2]]), head_dim=8), "positions: expected positions >= 0"),
        (lambda: axial_cos_sin(torch.tensor([[1, 2]]), head_dim=8, precision="fp16"), "precision"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(PosencError, match=match):
        call()
