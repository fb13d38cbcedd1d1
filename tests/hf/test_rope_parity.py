"""Parity of `Rope.from_hf_config(cfg).apply` with transformers' own rotary classes, per model type.

The oracle (tests/helpers/hf_oracle.py) runs transformers' config class, its `*RotaryEmbedding` module (fresh per call)
and the apply function its attention calls. Fixtures are real published config.json files.

bf16: transformers rounds cos/sin and every product to bf16, so its bf16 output is itself up to ~1.1x
TOL[bf16] away from its own fp32 result on randn inputs (measured). posenc rotates in fp32 and rounds once,
so its bf16 output is compared with transformers' fp32 result on the same bf16-rounded inputs (TOL[bf16]).
"""

import copy

import pytest
import torch
from tests.helpers.tolerances import assert_close

pytest.importorskip("transformers")

import posenc  # noqa: E402
from tests.helpers.hf_oracle import fixture_names, hf_apply, hf_config, hf_softmax_scale_factor, load_fixture  # noqa: E402

PER_LAYER = {"gemma-3-4b-it", "gemma-3-1b-v5"}
CASES = [(n, lt) for n in fixture_names() for lt in (("full_attention", "sliding_attention") if n in PER_LAYER else (None,))]
# transformers rotates bf16 inputs of these in float32 with float32 tables and rounds once (posenc's default) ...
FLOAT32_ROTATION = {"deepseek_v2", "olmo", "olmo2", "olmo3"}
# ... Cohere rounds the tables to bf16 but rotates in float32, GPT-J builds its fixed table by its own float32
# formula (equal within TOL[float32]): these two are compared under TOL[bf16] above only
NOT_BIT_EXACT = {"cohere", "cohere2", "gptj"}
BIG = 40000  # past original_max_position_embeddings of every scaled fixture


def _positions(cfg):
    top = min(BIG, (cfg.get("n_positions") or 10**9) - 1)  # GPT-J's table has n_positions rows
    scattered = torch.tensor([0, 1, 2, 100, 4095, 4096, 8191, 8192, 30000, top, 5, 17, 3]).clamp(max=top)
    rows = torch.stack([torch.arange(9) + 3, torch.arange(9) * 37])  # [b=2, t=9]: a short and a long row
    return [torch.arange(7), scattered, rows, rows[:1]]


def _check(cfg, rope, pos, layer_type=None, gen=None):
    b = pos.shape[-2] if pos.ndim >= 2 else 1
    q = torch.randn(b, 3, pos.shape[-1], rope.head_dim, generator=gen)  # GQA: 3 query heads, 1 key head
    k = torch.randn(b, 1, pos.shape[-1], rope.head_dim, generator=gen)
    expected = hf_apply(cfg, q, k, pos, layer_type)
    for got, want in zip(rope.apply(q, k, pos), expected):
        assert_close(got, want, msg=f"fp32 positions {pos.tolist()}")
    qb, kb = q.bfloat16(), k.bfloat16()
    expected = hf_apply(cfg, qb.float(), kb.float(), pos, layer_type)
    for got, want in zip(rope.apply(qb, kb, pos), expected):
        assert got.dtype == torch.bfloat16
        assert_close(got, want.bfloat16(), msg=f"bf16 positions {pos.tolist()}")
    model_type = posenc.hf.text_config(posenc.hf.config_to_dict(cfg))["model_type"]
    if model_type not in NOT_BIT_EXACT:  # transformers' own bf16 arithmetic, repeated bit for bit
        compute = None if model_type in FLOAT32_ROTATION else torch.bfloat16
        for got, want in zip(rope.apply(qb, kb, pos, compute_dtype=compute), hf_apply(cfg, qb, kb, pos, layer_type)):
            assert torch.equal(got, want), f"bf16 arithmetic ({compute}), positions {pos.tolist()}"


def test_enough_fixtures():
    assert len(fixture_names()) >= 20


@pytest.mark.parametrize("name,layer_type", CASES)
def test_fixture_parity(name, layer_type, gen):
    cfg = load_fixture(name)
    rope = posenc.Rope.from_hf_config(cfg, layer_type=layer_type)
    for pos in _positions(cfg):
        _check(cfg, rope, pos, layer_type, gen)


@pytest.mark.parametrize("name,layer_type", CASES)
def test_config_object_equals_dict(name, layer_type):
    cfg = load_fixture(name)
    from_dict = posenc.Rope.from_hf_config(cfg, layer_type=layer_type)
    assert posenc.Rope.from_hf_config(hf_config(cfg), layer_type=layer_type) == from_dict
    # transformers' own 5.x serialisation (rope_parameters) of the same config gives the same Rope
    assert posenc.Rope.from_hf_config(hf_config(cfg).to_dict(), layer_type=layer_type) == from_dict


def _to_v4(cfg):
    cfg = copy.deepcopy(cfg)
    params = cfg.pop("rope_parameters")
    if set(params) <= {"full_attention", "sliding_attention"}:  # Gemma 3: rope_scaling + rope_local_base_freq
        cfg["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        params = params["full_attention"]
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params
    return cfg


def _to_v5(cfg):
    cfg = copy.deepcopy(cfg)
    params = dict(cfg.pop("rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = cfg.pop("rope_theta")
    cfg["rope_parameters"] = params
    return cfg


@pytest.mark.parametrize("name", ["llama-3.2-1b-v5", "qwen3-8b-v5", "gemma-3-1b-v5"])
def test_v5_fixture_equals_its_v4_form(name):
    cfg = load_fixture(name)
    for lt in ("full_attention", "sliding_attention") if name in PER_LAYER else (None,):
        assert posenc.Rope.from_hf_config(_to_v4(cfg), layer_type=lt) == posenc.Rope.from_hf_config(cfg, layer_type=lt)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "vicuna-7b-v1.5-16k", "qwen2.5-7b-instruct-yarn", "gpt-oss-20b",
                                  "deepseek-v3", "mixtral-8x7b"])
def test_v4_fixture_equals_its_v5_form(name):
    cfg = load_fixture(name)
    assert posenc.Rope.from_hf_config(_to_v5(cfg)) == posenc.Rope.from_hf_config(cfg)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "llama-3.1-8b", "gpt-oss-20b"])
def test_softmax_scale_factor(name):
    cfg = load_fixture(name)
    want = hf_softmax_scale_factor(cfg)
    assert posenc.Rope.from_hf_config(cfg).softmax_scale_factor == pytest.approx(want, rel=1e-12)
    if name.startswith("deepseek"):
        assert want > 1.5  # the check is not vacuous: mscale_all_dim is set in both configs


def test_mrope_three_axis_positions(gen):
    for name in ("qwen2-vl-7b-instruct", "qwen2.5-vl-7b-instruct"):
        cfg = load_fixture(name)
        rope = posenc.Rope.from_hf_config(cfg)
        t_axis = torch.tensor([[0, 1, 2, 2, 2, 2, 7, 8, 9000]])
        pos = torch.stack([t_axis, t_axis.clamp(max=3) + torch.tensor([0, 0, 0, 0, 1, 1, 0, 0, 0]),
                           t_axis.clamp(max=3) + torch.tensor([0, 0, 0, 1, 0, 1, 0, 0, 0])])  # [3, b=1, t=9]
        _check(cfg, rope, pos, gen=gen)


def _small(model_type, **kw):
    return {"model_type": model_type, "hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 2048, **kw}


# Configs beyond the fixtures: every other supported model type, rope type and key spelling, at small sizes.
VARIANTS = {
    "llama-dynamic": (_small("llama", rope_scaling={"type": "dynamic", "factor": 2.0}), [None]),
    "qwen2-yarn-explicit": (_small("qwen2", rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 16,
        "beta_slow": 2, "attention_factor": 1.25}), [None]),
    "mistral-yarn-no-factor-l0": (_small("mistral", head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                                  [None]),
    "falcon-linear": (_small("falcon", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.5}), [None]),
    "gpt-neox-base": (_small("gpt_neox", rotary_emb_base=7000, rotary_pct=0.5, rope_theta=123.0), [None]),
    "gpt-neox-defaults": (_small("gpt_neox"), [None]),
    "persimmon": (_small("persimmon", rope_theta=25000.0), [None]),
    "stablelm-default-partial": (_small("stablelm"), [None]),
    "phi-default-partial": (_small("phi", hidden_size=128), [None]),
    "phi-dynamic": (_small("phi", partial_rotary_factor=0.5, rope_scaling={"type": "dynamic", "factor": 3.0}), [None]),
    "phi3-longrope-partial": (_small("phi3", hidden_size=64, partial_rotary_factor=0.75, original_max_position_embeddings=512,
                                     rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.5, 2.0, 3.0],
                                                   "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}), [None]),
    "glm4": (_small("glm4", head_dim=32), [None]),
    "cohere2": (_small("cohere2", num_hidden_layers=4, rope_theta=5e4), ["sliding_attention"]),
    "olmo3-yarn": (_small("olmo3", num_hidden_layers=4, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}),
        ["full_attention", "sliding_attention"]),
    "gemma3-text-v4-defaults": (_small("gemma3_text", num_hidden_layers=6, head_dim=16),
                                ["full_attention", "sliding_attention"]),
    "exaone4": (_small("exaone4", rope_theta=1e6), ["sliding_attention"]),
    "exaone4-no-window": (_small("exaone4", rope_theta=1e6, sliding_window=None, num_hidden_layers=4,
                                 layer_types=["full_attention"] * 4), [None, "full_attention"]),
    "smollm3-three-layers": (_small("smollm3", num_hidden_layers=3), [None]),  # NoPE from the 4th layer on
    "granite": (_small("granite", rope_theta=1e7), [None]),
    "ministral": (_small("ministral", head_dim=32), [None]),
    "mixtral-default-theta": (_small("mixtral"), [None]),
    "qwen3-default-head-dim": (_small("qwen3"), [None]),
    "gemma-default-head-dim": (_small("gemma"), [None]),
    "cohere-default-theta": (_small("cohere", rope_scaling={"rope_type": "linear", "factor": 2.0}), [None]),
    "deepseek-v3-split-half": (_small("deepseek_v3", qk_rope_head_dim=16, rope_interleave=False, rope_scaling={
        "type": "yarn", "factor": 4, "mscale": 0.5, "mscale_all_dim": 1.0, "original_max_position_embeddings": 512}),
        [None]),
    "deepseek-v2-default": (_small("deepseek_v2", qk_rope_head_dim=32, rope_theta=1e5), [None]),
    "gpt-oss-small": (_small("gpt_oss", head_dim=32), [None]),
    "qwen2-vl-v5-nested": ({"model_type": "qwen2_vl", "text_config": {
        "model_type": "qwen2_vl_text", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3]}}}, [None]),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_parity(name, gen):
    cfg, layer_types = VARIANTS[name]
    for lt in layer_types:
        rope = posenc.Rope.from_hf_config(cfg, layer_type=lt)
        for pos in _positions(cfg):
            _check(cfg, rope, pos, lt, gen)
        assert posenc.Rope.from_hf_config(hf_config(cfg), layer_type=lt) == rope


@pytest.mark.parametrize("name,switch", [("phi3-longrope-partial", 512), ("llama-dynamic", 2048)])
def test_length_dependent_rules_switch(name, switch):
    """Dynamic NTK and LongRoPE change table at the switch length; both sides agree with transformers."""
    cfg, _ = VARIANTS[name]
    rope = posenc.Rope.from_hf_config(cfg)
    below, above = torch.tensor([0, 3, switch - 1]), torch.tensor([0, 3, switch])
    assert not torch.equal(rope.cos_sin(below)[0][-1], rope.cos_sin(above)[0][-1])  # the switch is real
    for pos in (below, above, torch.tensor([[5, switch + 300]])):
        _check(cfg, rope, pos)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "mistral-7b-v0.1", "qwen2.5-7b-instruct-yarn", "gemma-2-9b",
                                  "phi-3.5-mini", "gpt-oss-20b", "glm-4-9b-chat-hf",
                                  "deepseek-v3", "qwen2-vl-7b-instruct"])
def test_bf16_arithmetic_of_transformers_bit_for_bit(name, gen):
    """compute_dtype=bfloat16 rounds tables, products and sums to bf16 as transformers does: equal bit for bit.

    Not every family rounds this way in transformers: GPT-J and DeepSeek-V2 rotate in float32 (posenc's default),
    and Cohere rounds the tables to bf16 but rotates in float32; those are left out here.
    """
    cfg = load_fixture(name)
    rope = posenc.Rope.from_hf_config(cfg)
    pos = torch.stack([torch.arange(40) * 97, torch.arange(40) + 4000])  # [b=2, t=40], past L0 for scaled configs
    if rope.mrope_section:
        pos = pos[None].expand(3, -1, -1)
    q = torch.randn(2, 4, 40, rope.head_dim, generator=gen).bfloat16()
    k = torch.randn(2, 2, 40, rope.head_dim, generator=gen).bfloat16()
    want = hf_apply(cfg, q, k, pos)
    got = rope.apply(q, k, pos, compute_dtype=torch.bfloat16)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bfloat16
        assert torch.equal(g, w), f"max diff {(g.float() - w.float()).abs().max()}"
