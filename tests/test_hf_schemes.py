"""Rotary schemes of newer families against transformers' own rotary classes and apply functions, on random
tensors and multi-axis positions: Ernie 4.5 VL's h/w-alternating M-RoPE.
"""

import pytest
import torch
from oracles import rotate_angles

import posenc
import posenc.hf
from posenc import PosencError

transformers = pytest.importorskip("transformers")

ERNIE = {"model_type": "ernie4_5_vl_moe_text", "hidden_size": 80, "num_attention_heads": 2, "head_dim": 40,
         "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 32, "max_position_embeddings": 4096,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [6, 6, 8]}}


def _hf(cfg):
    return transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


def _axes(gen, t):
    """[3, 1, t] positions whose three rows differ (text, then an image's rows and columns)."""
    return torch.stack([torch.randint(0, 3000, (t,), generator=gen) for _ in range(3)])[:, None]


@pytest.mark.parametrize("section", [[6, 6, 8], [2, 2, 16], [4, 4, 12]])
def test_ernie_vl_mrope_matches_transformers(section):
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as m

    cfg = {**ERNIE, "rope_parameters": {**ERNIE["rope_parameters"], "mrope_section": section}}
    config = _hf(cfg)
    rope = posenc.Rope.from_hf_config(cfg)
    assert rope == posenc.Rope.from_hf_config(config) and rope.pairing == "interleaved"
    gen = torch.Generator().manual_seed(sum(section))
    q, k = torch.randn(2, 2, 13, 40, generator=gen), torch.randn(2, 1, 13, 40, generator=gen)
    pos = _axes(gen, 13).expand(3, 2, 13)
    rotary = m.Ernie4_5_VLMoeTextRotaryEmbedding(config)
    cos, sin = rotary(q, pos)
    want = m.apply_rotary_pos_emb(q, k, cos, sin)
    got = rope.apply(q, k, pos)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the 2x2 oracle from the stated rule: pair j < 2 s_h follows axis 1 (j even) or 2 (j odd), the rest axis 0,
    # each at its own ladder frequency base**(-2j / d)
    s_h = section[0]
    axis = torch.tensor([1 + j % 2 if j < 2 * s_h else 0 for j in range(20)])
    inv = (1.0 / 500000.0 ** (torch.arange(0, 40, 2, dtype=torch.int64).float() / 40)).double()  # [20]
    angles = pos.double()[axis, :, :].permute(1, 2, 0) * inv  # [b, t, 20]
    oracle = rotate_angles(q, angles[:, None], "interleaved")
    assert torch.allclose(rope.apply(q, k, pos, precision="exact")[0].double(), oracle, atol=1e-5)


@pytest.mark.parametrize("section, match", [([6, 7, 7], "s_h == s_w"), ([6, 6], "3 integers"), ([10, 10, 0], "s_t >= 1"),
                                            ([6, 6, 9], "sections summing to rotary_dim / 2 = 20")])
def test_ernie_vl_bad_sections_name_the_key(section, match):
    cfg = {**ERNIE, "rope_parameters": {**ERNIE["rope_parameters"], "mrope_section": section}}
    with pytest.raises(PosencError, match=r"config\['rope_parameters'\]\['mrope_section'\]: expected .*" + match):
        posenc.hf.rope_by_layer_type(cfg)
