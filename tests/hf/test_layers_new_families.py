"""Families of 2025-26 against transformers' own code: Llama 4 (interleaved pairs on a complex table, NoPE layers,
query temperature on them, Llama-3 scaling with low_freq_factor == high_freq_factor as published), Ministral 3's
query temperature, and the config-class defaults read for a dict of a model type outside the `Convention` table.
"""

import math

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoConfig  # noqa: E402

import posenc  # noqa: E402
import posenc.hf  # noqa: E402
from posenc.rope.temperature import QueryTemperature  # noqa: E402

LLAMA4 = {"model_type": "llama4_text", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "num_hidden_layers": 8, "vocab_size": 32, "intermediate_size": 32,
          "intermediate_size_mlp": 32, "max_position_embeddings": 65536, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192},
          "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "no_rope_layers": []}


def hf(cfg):
    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


def test_llama4_rotation_and_nope_layers_match_transformers():
    from transformers.models.llama4 import modeling_llama4 as m

    config = hf(LLAMA4)
    ropes = posenc.hf.layer_ropes(LLAMA4)
    assert [r is None for r in ropes] == [not config.no_rope_layers[i] for i in range(8)]  # transformers' rule
    assert [r is None for r in ropes] == [(i + 1) % 4 == 0 for i in range(8)]
    rope = next(r for r in ropes if r is not None)
    assert posenc.hf.layer_ropes(config) == ropes  # the PretrainedConfig reads the same
    rotary = m.Llama4TextRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 5, 16, generator=gen), torch.randn(1, 2, 5, 16, generator=gen)
    pos = torch.tensor([[0, 1, 8191, 8192, 60000]])
    freqs_cis = rotary(q, pos)
    want = [x.transpose(1, 2) for x in m.apply_rotary_emb(q.transpose(1, 2), k.transpose(1, 2), freqs_cis)]
    got = rope.apply(q, k, pos[0])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.equal(rope.inv_freq()[0], rotary.inv_freq)


def test_llama4_temperature_on_nope_layers_matches_its_attention_formula():
    temps = posenc.hf.layer_temperatures(LLAMA4)
    ropes = posenc.hf.layer_ropes(LLAMA4)
    assert [t is not None for t in temps] == [r is None for r in ropes]
    pos = torch.tensor([0, 8190, 8191, 8192, 100000])
    # transformers' Llama4TextAttention: log1p(floor((positions + 1) / floor_scale)) * attn_scale + 1, float32
    want = torch.log1p(torch.floor((pos.float() + 1.0) / 8192)) * 0.1 + 1.0
    assert torch.equal(temps[3].scale(pos), want)
    far = torch.arange(0, 8192 * 1024, 2048)  # every step up to 1024, where log1p and log(1 + x) part
    assert torch.equal(temps[3].scale(far), torch.log1p(torch.floor((far.float() + 1.0) / 8192)) * 0.1 + 1.0)
    closed = [1 + 0.1 * math.log(1 + math.floor((p + 1) / 8192)) for p in pos.tolist()]  # float64
    assert torch.allclose(temps[3].scale(pos).double(), torch.tensor(closed, dtype=torch.float64), rtol=1e-6)
    assert posenc.hf.layer_temperatures({**LLAMA4, "attn_temperature_tuning": False}) == (None,) * 8


def test_ministral3_temperature_matches_transformers_function():
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    config = AutoConfig.for_model("ministral3")
    temps = posenc.hf.layer_temperatures(config)
    assert len(set(temps)) == 1 and temps[0] == QueryTemperature(beta=0.1, floor_scale=16384, offset=0, log="log")
    pos = torch.tensor([[0, 16383, 16384, 50000, 262143]])
    want = get_llama_4_attn_scale(pos, 0.1, 16384)[0, 0, :, 0]  # [t]
    assert torch.equal(temps[0].scale(pos[0]), want)
    # far past the model's length too, where float32 log1p(x) and log(1 + x) part (x = 178, 401, ...): every
    # step up to 1024, bit for bit (log1p differs at some of them: the test sees the spelling)
    pos = torch.arange(0, 16384 * 1024, 4096).view(1, -1)
    want = get_llama_4_attn_scale(pos, 0.1, 16384)[0, 0, :, 0]
    assert torch.equal(temps[0].scale(pos[0]), want)
    assert not torch.equal(QueryTemperature(beta=0.1, floor_scale=16384).scale(pos[0]), want)
    assert posenc.hf.layer_temperatures(config.to_dict()) == temps


def test_bad_temperature_values_are_named():
    with pytest.raises(posenc.PosencError, match="attn_temperature_tuning"):
        posenc.hf.layer_temperatures({**LLAMA4, "attn_temperature_tuning": "yes"})
    with pytest.raises(posenc.PosencError, match="floor_scale"):
        posenc.hf.layer_temperatures({**LLAMA4, "floor_scale": 0})
    with pytest.raises(posenc.PosencError, match="beta"):
        QueryTemperature(beta=-1.0, floor_scale=8192)
    with pytest.raises(posenc.PosencError, match=r"^log: expected one of \('log1p', 'log'\), got 'ln'"):
        QueryTemperature(beta=0.1, floor_scale=8192, log="ln")


def test_dict_of_a_type_outside_the_table_gets_its_config_class_defaults():
    """seed_oss is not in the Convention table: its config class's default head_dim and rope_theta apply to a dict
    that omits them, as transformers' own rotary class sees them."""
    from transformers.models.seed_oss import modeling_seed_oss as m

    cfg = {"model_type": "seed_oss", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "vocab_size": 32, "intermediate_size": 32}
    config = hf(cfg)
    rope = posenc.Rope.from_hf_config(cfg)
    rotary = m.SeedOssRotaryEmbedding(config)
    assert rope.head_dim == (getattr(config, "head_dim", None) or 16)
    assert rope.base == config.rope_parameters["rope_theta"]
    assert torch.equal(rope.inv_freq()[0], rotary.inv_freq)
