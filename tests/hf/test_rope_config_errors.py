"""Bad transformers configs raise PosencError naming the argument, what was expected and what arrived."""

import math
import re

import pytest

import posenc
from posenc import PosencError

BASE = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 2048}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LONG = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


def cfg(**kw):
    return {**BASE, **kw}


def phi3(**scaling):
    return cfg(model_type="phi3", original_max_position_embeddings=512, rope_scaling={**LONG, **scaling})


# (id, config, layer_type, regex the message must match: the argument, then what arrived)
CASES = [
    ("none", None, None, r"config: expected a config.json dict .*got NoneType"),
    ("list", [("model_type", "llama")], None, r"config: expected a config.json dict .*got list"),
    ("string", "llama", None, r"config: expected .*got str"),
    ("empty", {}, None, r"config\['model_type'\]: expected a model type name such as 'llama'.*got nothing"),
    ("no-positions-model", cfg(model_type="mamba"), None,
     r"model_type'\]: expected a model whose rotation posenc models, got 'mamba', which applies no positional"),
    ("bloom", cfg(model_type="bloom"), None, r"model_type'\]: expected a model that uses RoPE, got 'bloom'.*ALiBi"),
    ("t5", cfg(model_type="t5"), None, r"model_type'\]: .*got 't5'.*T5 relative"),
    ("gpt2", cfg(model_type="gpt2"), None, r"got 'gpt2'.*learned"),
    ("mpt", cfg(model_type="mpt"), None, r"got 'mpt'.*ALiBi"),
    ("bert", cfg(model_type="bert"), None, r"got 'bert'"),
    ("falcon-alibi", cfg(model_type="falcon", alibi=True), None, r"config\['alibi'\]: expected false .*ALiBi"),
    ("theta-string", cfg(rope_theta="10000"), None, r"config\['rope_theta'\]: expected a real number, got '10000'"),
    ("theta-zero", cfg(rope_theta=0), None, r"rope_theta'\]: expected a finite number > 0, got 0"),
    ("theta-negative", cfg(rope_theta=-5.0), None, r"rope_theta'\]: expected .*got -5.0"),
    ("theta-inf", cfg(rope_theta=math.inf), None, r"rope_theta'\]: expected .*got inf"),
    ("theta-nan", cfg(rope_theta=math.nan), None, r"rope_theta'\]: expected .*got nan"),
    ("theta-one", cfg(rope_theta=1.0), None, r"rope_theta'\]: expected a number other than 1.*got 1.0"),
    ("theta-v5-nested", cfg(rope_parameters={"rope_type": "default", "rope_theta": None, "bogus": 1}), None,
     r"config\['rope_parameters'\]\['bogus'\]: expected one of the keys of rope_type 'default'.*got 'bogus'"),
    ("unknown-rope-type", cfg(rope_scaling={"rope_type": "ntk-by-parts", "factor": 2.0}), None,
     r"config\['rope_scaling'\]\['rope_type'\]: expected one of the known rope types \('default', 'linear'.*got 'ntk-by-parts'"),
    ("rope-type-not-str", cfg(rope_scaling={"rope_type": 3, "factor": 2.0}), None, r"rope_type'\]: expected a rope type name.*got 3"),
    ("type-disagrees", cfg(rope_scaling={"type": "linear", "rope_type": "dynamic", "factor": 2.0}), None,
     r"config\['rope_scaling'\]\['type'\]: expected the same rope type as rope_type='dynamic'.*got 'linear'"),
    ("linear-no-factor", cfg(rope_scaling={"type": "linear"}), None,
     r"config\['rope_scaling'\]\['factor'\]: expected a value \(required for rope_type 'linear'\), got nothing"),
    ("llama3-missing-low", cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}), None,
     r"\['low_freq_factor'\]: expected a value \(required .*'llama3'\), got nothing"),
    ("longrope-missing-long", phi3(long_factor=None), None, r"\['long_factor'\]: expected a value .*got nothing"),
    ("foreign-beta-fast-on-linear", cfg(rope_scaling={"type": "linear", "factor": 2.0, "beta_fast": 32}), None,
     r"config\['rope_scaling'\]\['beta_fast'\]: expected no such key for rope_type 'linear' \(it belongs to \['yarn'\]\), got 32"),
    ("foreign-long-factor-on-yarn", cfg(rope_scaling={**YARN, "long_factor": [1.0]}), None,
     r"\['long_factor'\]: expected no such key for rope_type 'yarn' .*longrope"),
    ("typo-key", cfg(rope_scaling={"type": "linear", "factor": 2.0, "rope_thetha": 1e4}), None,
     r"\['rope_thetha'\]: expected one of the keys of rope_type 'linear'.*got 'rope_thetha'"),
    ("factor-zero", cfg(rope_scaling={"type": "linear", "factor": 0}), None, r"\['factor'\]: expected a finite number > 0, got 0"),
    ("factor-negative", cfg(rope_scaling={"type": "dynamic", "factor": -2.0}), None, r"\['factor'\]: expected .*got -2.0"),
    ("factor-inf", cfg(rope_scaling={**YARN, "factor": math.inf}), None, r"\['factor'\]: expected .*got inf"),
    ("factor-nan", cfg(rope_scaling={**LLAMA3, "factor": math.nan}), None, r"\['factor'\]: expected .*got nan"),
    ("factor-string", cfg(rope_scaling={"type": "linear", "factor": "2"}), None, r"\['factor'\]: expected a real number, got '2'"),
    ("yarn-beta-equal", cfg(rope_scaling={**YARN, "beta_fast": 4, "beta_slow": 4}), None,
     r"\['beta_fast'\]: expected a value greater than beta_slow=4(\.0)?, got 4(\.0)?"),
    ("yarn-beta-reversed", cfg(rope_scaling={**YARN, "beta_fast": 1, "beta_slow": 32}), None,
     r"\['beta_fast'\]: expected a value greater than beta_slow=32(\.0)?, got 1(\.0)?"),
    ("yarn-truncate-string", cfg(rope_scaling={**YARN, "truncate": "no"}), None, r"\['truncate'\]: expected True or False, got 'no'"),
    ("yarn-bad-l0", cfg(rope_scaling={**YARN, "original_max_position_embeddings": -1}), None,
     r"original_max_position_embeddings'\]: expected a positive integer, got -1"),
    ("llama3-low-above-high", cfg(rope_scaling={**LLAMA3, "low_freq_factor": 5.0}), None,
     r"\['low_freq_factor'\]: expected a value not above high_freq_factor=4.0, got 5.0"),
    ("longrope-wrong-length", phi3(short_factor=[1.0] * 5, long_factor=[1.0] * 5), None,
     r"config\['rope_scaling'\]\['short_factor'\]: expected 8 values \(rotary_dim / 2\), got 5"),
    ("longrope-lengths-differ", phi3(long_factor=[1.0] * 7), None, r"\['long_factor'\]: expected 8 values .*got 7"),
    ("longrope-non-numeric", phi3(short_factor=[1.0] * 7 + ["x"]), None, r"\['short_factor'\]\[7\]: expected a real number, got 'x'"),
    ("longrope-not-list", phi3(short_factor="1.0"), None, r"\['short_factor'\]: expected a list of positive numbers.*got '1.0'"),
    ("phi3-rejects-linear", cfg(model_type="phi3", rope_scaling={"type": "linear", "factor": 2.0}), None,
     r"\['rope_type'\]: expected one of \('default', 'longrope'\) .*got 'linear'"),
    ("partial-zero", cfg(model_type="phi", partial_rotary_factor=0), None, r"config\['partial_rotary_factor'\]: expected a finite number in \(0, 1\], got 0"),
    ("partial-1.5", cfg(model_type="stablelm", partial_rotary_factor=1.5), None, r"config\['partial_rotary_factor'\]: expected .*got 1.5"),
    ("partial-string", cfg(model_type="phi", partial_rotary_factor="half"), None, r"config\['partial_rotary_factor'\]: expected .*got 'half'"),
    ("partial-odd-width", cfg(model_type="phi", partial_rotary_factor=0.1875), None,
     r"config\['partial_rotary_factor'\]: expected a fraction giving an even, non-zero rotary width of head_dim=16, got 0.1875 -> 3"),
    ("partial-rotary-pct", cfg(model_type="gpt_neox", rotary_pct=2.0), None, r"config\['rotary_pct'\]: expected .*got 2.0"),
    ("partial-on-llama-yarn", cfg(partial_rotary_factor=0.5, rope_scaling=YARN), None,
     r"config\['partial_rotary_factor'\]: expected 1.0 for llama with rope_type 'yarn'.*got 0.5"),
    ("odd-head-dim", cfg(head_dim=15), None, r"head_dim: expected an even number of channels.*got 15"),
    ("head-dim-negative", cfg(head_dim=-8), None, r"config\['head_dim'\]: expected a positive integer, got -8"),
    ("hidden-not-multiple", cfg(hidden_size=66), None, r"config\['hidden_size'\]: expected a multiple of num_attention_heads=4.*got 66"),
    ("heads-missing", {"model_type": "llama", "hidden_size": 64}, None, r"config\['num_attention_heads'\]: expected a positive integer, got nothing"),
    ("gptj-rotary-null", cfg(model_type="gptj", rotary_dim=None), None, r"config\['rotary_dim'\]: expected an integer .*got None"),
    ("mrope-sum", cfg(model_type="qwen2_vl", rope_scaling={"type": "mrope", "mrope_section": [2, 3, 4]}), None,
     r"config\['rope_scaling'\]\['mrope_section'\]: expected sections summing to rotary_dim / 2 = 8, got \[2, 3, 4\]"),
    ("mrope-not-list", cfg(model_type="qwen2_vl", rope_scaling={"type": "mrope", "mrope_section": 8}), None,
     r"\['mrope_section'\]: expected a list of 3 integers.*got 8"),
    ("rope-scaling-not-dict", cfg(rope_scaling="linear"), None, r"config\['rope_scaling'\]: expected a dict of rope parameters or null, got 'linear'"),
    ("gemma3-no-layer-type", cfg(model_type="gemma3_text", head_dim=16), None,
     r"layer_type: expected one of \['full_attention', 'sliding_attention'\] .*different RoPE per layer type.*got None"),
    ("gemma3-v5-no-layer-type", cfg(model_type="gemma3_text", head_dim=16, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), None, r"layer_type: expected one of .*got None"),
    ("gemma3-bad-layer-type", cfg(model_type="gemma3_text", head_dim=16), "global", r"layer_type: expected one of .*got 'global'"),
    ("layer-type-not-str", cfg(), 3, r"layer_type: expected a layer type name .*got 3"),
    ("layer-type-unknown", cfg(), "chunked_attention", r"layer_type: expected one of .*got 'chunked_attention'"),
    ("gptj-scaling-ignored", cfg(model_type="gptj", rotary_dim=8, rope_scaling={"type": "linear", "factor": 2.0}), None,
     r"config\['rope_scaling'\]\['rope_type'\]: expected one of \('default',\) .*got 'linear'"),
    ("gptj-theta-ignored", cfg(model_type="gptj", rotary_dim=8, rope_theta=5e5), None,
     r"config\['rope_theta'\]: expected 10000.0 or no key \(gptj's table is fixed.*got 500000.0"),
    ("falcon-head-dim", cfg(model_type="falcon", head_dim=8), None,
     r"config\['head_dim'\]: expected hidden_size / num_attention_heads = 16 or no key .*got 8"),
    ("cohere2-nope-layer", cfg(model_type="cohere2", num_hidden_layers=4), "full_attention",
     r"layer_type: expected a layer type that uses RoPE \(cohere2 full_attention layers use no positional encoding\)"),
]


@pytest.mark.parametrize("config,layer_type,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_raises(config, layer_type, pattern):
    with pytest.raises(PosencError, match=pattern):
        posenc.Rope.from_hf_config(config, layer_type=layer_type)


def test_error_is_a_value_error_and_names_known_rope_types():
    with pytest.raises(ValueError) as info:
        posenc.Rope.from_hf_config(cfg(rope_scaling={"rope_type": "xpos"}))
    for name in ("default", "linear", "dynamic", "yarn", "longrope", "llama3"):
        assert repr(name) in str(info.value)


def test_valid_neighbours_of_the_bad_cases_build():
    """The cases above fail for the stated reason: the nearest valid configs build."""
    assert posenc.Rope.from_hf_config(cfg(rope_scaling={"type": "linear", "factor": 2.0})).rotary_dim == 16
    assert posenc.Rope.from_hf_config(cfg(model_type="phi", partial_rotary_factor=0.25)).rotary_dim == 4
    assert posenc.Rope.from_hf_config(cfg(partial_rotary_factor=0.5)).rotary_dim == 16  # llama's default ignores it
    assert posenc.Rope.from_hf_config(phi3()).scaling.long_factor == (2.0,) * 8
    rope = posenc.Rope.from_hf_config(cfg(model_type="gemma3_text", head_dim=16), layer_type="sliding_attention")
    assert rope.base == 10000.0
    same = cfg(model_type="gemma3_text", head_dim=16, rope_theta=1e4)  # equal layers: layer_type not needed
    assert posenc.Rope.from_hf_config(same).base == 10000.0
    assert posenc.Rope.from_hf_config(cfg(model_type="cohere2", num_hidden_layers=4), layer_type="sliding_attention")
    assert re.search("ALiBi", str(pytest.raises(PosencError, posenc.Rope.from_hf_config, cfg(model_type="bloom")).value))


def test_a_rule_keeps_the_step_length_of_ministral3_temperature():
    """Ministral 3's attention reads original_max_position_embeddings next to llama_4_scaling_beta whatever the
    rule (its query temperature's step length), so a linear or dynamic dict carries it; without the beta the key
    is still not the rule's."""
    temperature = {"llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 16384}
    for rule in ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}):
        rope = posenc.Rope.from_hf_config(cfg(model_type="ministral3", rope_parameters={**rule, **temperature}))
        assert (rope.scaling.name, rope.scaling.factor) == (rule["rope_type"], 2.0)
        with pytest.raises(PosencError, match=r"\['original_max_position_embeddings'\]: expected no such key for "
                                              rf"rope_type '{rule['rope_type']}'"):
            posenc.Rope.from_hf_config(cfg(model_type="ministral3", rope_parameters={
                **rule, "original_max_position_embeddings": 16384}))


def phimoe(**params):
    return cfg(model_type="phimoe", rope_parameters={**LONG, "short_factor": [1.5] * 8, "original_max_position_embeddings": 512,
                                                     **params})


def test_phimoe_longrope_keeps_the_short_factors_times_its_mscale():
    """PhimoeRotaryEmbedding builds its table without a length (the short factors at every length) and multiplies
    cos/sin by short_mscale / long_mscale; posenc reads equal mscales, refuses unequal ones and other rules."""
    rope = posenc.Rope.from_hf_config(phimoe(short_mscale=1.2, long_mscale=1.2))
    assert rope.scaling.long_factor == rope.scaling.short_factor == (1.5,) * 8
    assert rope.scaling.attention_factor == 1.2
    with pytest.raises(PosencError, match=r"\['long_mscale'\]: expected short_mscale = 1.1 .*got 1.3"):
        posenc.Rope.from_hf_config(phimoe(short_mscale=1.1, long_mscale=1.3))
    with pytest.raises(PosencError, match=r"\['short_mscale'\]: expected .*got nothing"):
        posenc.Rope.from_hf_config(phimoe(long_mscale=1.3))
    with pytest.raises(PosencError, match=r"\['rope_type'\]: expected 'default' or 'longrope' for phimoe"):
        posenc.Rope.from_hf_config(cfg(model_type="phimoe", rope_parameters={
            "rope_type": "linear", "factor": 2.0, "short_mscale": 1.0, "long_mscale": 1.0}))
    with pytest.raises(PosencError, match=r"\['short_mscale'\]: expected one of the keys"):  # not another family's key
        posenc.Rope.from_hf_config(phi3(short_mscale=1.2, long_mscale=1.2))
