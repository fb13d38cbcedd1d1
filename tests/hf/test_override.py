"""posenc.hf.override.with_rope_rule: the one place a RoPE rule is written back into a config dict."""

import pytest

import posenc
from posenc.hf.override import with_rope_rule

transformers = pytest.importorskip("transformers")

BASE = {"model_type": "llama", "vocab_size": 10, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 8, "rope_theta": 5e5, "max_position_embeddings": 64}


@pytest.mark.parametrize("rule", [
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 4.0},
    {"type": "linear", "factor": 4.0},  # transformers 4.x spelling
    {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16},
])
def test_the_written_rule_is_the_rope_transformers_builds(rule):
    cfg = with_rope_rule(BASE, rule)
    hf_config = transformers.LlamaConfig(**cfg)
    assert posenc.Rope.from_hf_config(cfg) == posenc.Rope.from_hf_config(hf_config)
    assert hf_config.rope_parameters["rope_theta"] == 5e5 == cfg["rope_theta"]
    assert hf_config.max_position_embeddings == rule.get("max_position_embeddings", 64)
    kind = rule.get("rope_type", rule.get("type"))
    assert type(posenc.Rope.from_hf_config(cfg).scaling).__name__.lower().startswith(kind[:3])


def test_the_config_is_copied_and_the_rule_theta_wins():
    before = dict(BASE, rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = with_rope_rule(before, {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4})
    assert before["rope_scaling"] == {"rope_type": "linear", "factor": 8.0} and "rope_parameters" not in before
    assert "rope_scaling" not in cfg and cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"] == 1e4
    assert with_rope_rule(before, None) == before


def test_a_theta_inside_the_old_rope_parameters_is_kept():
    cfg = with_rope_rule({"rope_parameters": {"rope_type": "default", "rope_theta": 123.0}}, {"rope_type": "linear",
                                                                                          "factor": 2.0})
    assert cfg["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 123.0}


@pytest.mark.parametrize("rule, match", [
    ("yarn", r"^rope_scaling: expected None or a transformers-style dict"),
    ({"rope_type": "dynamic", "max_position_embeddings": 0}, r"^rope_scaling\['max_position_embeddings'\]: expected"),
])
def test_bad_rules_are_refused(rule, match):
    with pytest.raises(posenc.PosencError, match=match):
        with_rope_rule(BASE, rule)
