"""Cohere Compass's multi-axis RoPE, per layer type, against transformers' own rotary module and apply function
(its recomposition is Qwen3-VL's interleaved one; its default rope rotates the whole head)."""

import pytest
import torch

pytest.importorskip("transformers")

import posenc  # noqa: E402


def _config():
    from transformers import CohereCompassTextConfig

    params = {"full_attention": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}}
    return CohereCompassTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters=params)


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_three_axis_rotation_matches_transformers(layer_type):
    from transformers.models.cohere_compass import modeling_cohere_compass as m

    config = _config()
    t = torch.tensor([0, 1, 2, 2, 2, 2, 7, 8, 900])
    positions = torch.stack([t, t.clamp(max=3) + torch.tensor([0, 0, 0, 0, 1, 1, 0, 0, 0]),
                             t.clamp(max=3) + torch.tensor([0, 0, 0, 1, 0, 1, 0, 0, 0])])[:, None]  # [3, 1, 9]
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    with torch.no_grad():
        cos, sin = m.CohereCompassRotaryEmbedding(config)(q, positions, layer_type)
        want = m.apply_rotary_pos_emb(q, k, cos, sin)
    rope = posenc.Rope.from_hf_config(config, layer_type=layer_type)
    assert rope.mrope_section is not None and rope.rotary_dim == 16
    for got, expected in zip(rope.apply(q, k, positions), want):
        assert torch.equal(got, expected)
