"""p-RoPE (`posenc.rope.proportional.Proportional`, transformers' "proportional"; Gemma 4's full-attention layers).

Oracles: transformers' own `_compute_proportional_rope_parameters` and Gemma 4's rotary class and apply function
(random configs and tensors), a float64 closed form of the ladder, and the 2x2 rotation oracle.
"""

import math

import pytest
import torch
from tests.helpers.oracles import rotate_angles

import posenc
import posenc.hf
from posenc import PosencError
from posenc.rope.proportional import Proportional


def closed_form(base: float, head_dim: int, fraction: float, factor: float) -> torch.Tensor:
    """float64: pair j < int(fraction * head_dim // 2) turns at base**(-2j / head_dim) / factor, the rest at 0."""
    angles = int(fraction * head_dim // 2)
    return torch.tensor([base ** (-2 * j / head_dim) / factor if j < angles else 0.0 for j in range(head_dim // 2)],
                        dtype=torch.float64)


@pytest.mark.parametrize("fraction,factor,head_dim,base", [
    (0.25, 1.0, 512, 1e6), (0.5, 8.0, 128, 1e6), (1.0, 1.0, 64, 1e4), (0.0, 1.0, 32, 1e4), (0.3, 2.5, 72, 5e5)])
def test_inverse_frequencies_are_the_full_head_ladder_truncated(fraction, factor, head_dim, base):
    inv, attention = Proportional(fraction=fraction, factor=factor).inv_freq(base, head_dim)
    assert inv.dtype == torch.float32 and inv.shape == (head_dim // 2,) and attention == 1.0
    want = closed_form(base, head_dim, fraction, factor)
    assert torch.allclose(inv.double(), want, rtol=2e-7, atol=0)
    assert int((inv == 0).sum()) == head_dim // 2 - int(fraction * head_dim // 2)


def test_rotation_matches_the_2x2_oracle_and_passes_the_zero_pairs_through():
    rope = posenc.Rope(head_dim=64, base=1e6, scaling=Proportional(fraction=0.25))
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, 5, 64, generator=gen), torch.randn(2, 1, 5, 64, generator=gen)
    pos = torch.tensor([0, 1, 9, 100, 4095])
    q2, k2 = rope.apply(q, k, pos)
    angles = pos[:, None].double() * closed_form(1e6, 64, 0.25, 1.0)  # [t, 32]
    # float32 angles: |error| <= 4095 * 2**-23 rad * |x| at the largest position
    assert torch.allclose(q2.double(), rotate_angles(q, angles), atol=3e-3)
    assert torch.allclose(k2.double(), rotate_angles(k, angles), atol=3e-3)
    zero = [j for j in range(32) if j >= 8]  # split-half pairs (j, j + 32) with frequency 0
    passthrough = zero + [j + 32 for j in zero]
    assert torch.equal(q2[..., passthrough], q[..., passthrough])


def _hf_proportional(head_dim, fraction, factor, base):
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = PretrainedConfig()
    cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim = head_dim * 2, 2, head_dim
    cfg.rope_parameters = {"rope_type": "proportional", "rope_theta": base, "partial_rotary_factor": fraction,
                           "factor": factor}
    return ROPE_INIT_FUNCTIONS["proportional"](cfg, None)


def test_matches_transformers_init_function_on_random_parameters():
    pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        head_dim = 2 * int(torch.randint(4, 300, (1,), generator=gen))
        fraction = round(float(torch.rand(1, generator=gen)), 3)
        factor = float(torch.randint(1, 9, (1,), generator=gen)) / 2
        base = 10 ** float(torch.empty(1).uniform_(3, 7, generator=gen))
        inv_hf, attention_hf = _hf_proportional(head_dim, fraction, factor, base)
        inv, attention = Proportional(fraction=fraction, factor=factor).inv_freq(base, head_dim)
        assert torch.equal(inv, inv_hf), (head_dim, fraction, factor, base)
        assert attention == attention_hf


def gemma4_text(**kw):
    return {"model_type": "gemma4_text", "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "global_head_dim": 64, "num_hidden_layers": 6, "vocab_size": 32,
            "intermediate_size": 32, "max_position_embeddings": 4096, "sliding_window": 8, "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
            **kw}


def test_gemma4_layers_match_transformers_rotation():
    pytest.importorskip("transformers")
    from transformers import AutoConfig
    from transformers.models.gemma4 import modeling_gemma4 as m

    cfg = gemma4_text()
    config = AutoConfig.for_model("gemma4_text", **{k: v for k, v in cfg.items() if k != "model_type"})
    rotary = m.Gemma4TextRotaryEmbedding(config)
    ropes = posenc.hf.rope_by_layer_type(cfg)
    assert ropes["full_attention"].head_dim == 64 and isinstance(ropes["full_attention"].scaling, Proportional)
    assert ropes["sliding_attention"].head_dim == 32 and ropes["sliding_attention"].base == 10000.0
    gen = torch.Generator().manual_seed(1)
    pos = torch.tensor([[0, 3, 4095, 9000]])
    for layer_type, rope in ropes.items():
        q, k = torch.randn(1, 2, 4, rope.head_dim, generator=gen), torch.randn(1, 1, 4, rope.head_dim, generator=gen)
        cos, sin = rotary(q, pos, layer_type)
        want = m.apply_rotary_pos_emb(q, cos, sin), m.apply_rotary_pos_emb(k, cos, sin)  # one tensor at a time
        got = rope.apply(q, k, pos[0])
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5), layer_type
    assert [r.head_dim for r in posenc.hf.layer_ropes(cfg)] == [32, 32, 32, 32, 32, 64]  # every 6th layer is full


@pytest.mark.parametrize("bad,pattern", [
    ({"partial_rotary_factor": 1.5}, r"\['full_attention'\]\['partial_rotary_factor'\]: expected a finite number in \[0, 1\]"),
    ({"factor": 0.0}, r"\['full_attention'\]\['factor'\]: expected a finite number > 0"),
    ({"beta_fast": 32.0}, r"\['full_attention'\]\['beta_fast'\]: expected no such key for rope_type 'proportional'"),
])
def test_bad_proportional_parameters_name_the_key(bad, pattern):
    cfg = gemma4_text()
    cfg["rope_parameters"]["full_attention"].update(bad)
    with pytest.raises(PosencError, match=pattern):
        posenc.Rope.from_hf_config(cfg, layer_type="full_attention")


def test_bad_values_of_the_value_itself():
    with pytest.raises(PosencError, match="partial_rotary_factor"):
        Proportional(fraction=-0.1)
    with pytest.raises(PosencError, match="factor"):
        Proportional(factor=math.inf)
