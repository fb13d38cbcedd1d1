"""Per-model facts read like transformers' own config classes and modules (the `Convention` table).

Each test pins one reading that once disagreed with transformers or between the dict and config-object paths:
Phi-3's class-level original length, per-layer RoPE (OLMo 3, Gemma 3, Cohere 2, EXAONE 4, SmolLM3), the legacy
`type` key of per-layer models, Qwen2-VL's mrope_interleaved, and head_dim when config.json omits it.
"""

import math

import pytest
import torch
from tests.helpers.tolerances import assert_close

pytest.importorskip("transformers")

import posenc  # noqa: E402
from tests.helpers.hf_oracle import hf_apply, hf_config  # noqa: E402
from posenc import PosencError  # noqa: E402
from posenc.hf import MODEL_TYPES, head_dim, kv_cache_facts, layer_ropes, layer_windows  # noqa: E402


def small(model_type, **kw):
    return {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "num_hidden_layers": 4, "vocab_size": 32, "intermediate_size": 32, "pad_token_id": 0, **kw}


def assert_parity(cfg, rope, positions, layer_type=None, seed=0):
    """`rope.apply` equals transformers' rotation of the same q, k at `positions` (fp32 table)."""
    gen = torch.Generator().manual_seed(seed)
    b = positions.shape[-2] if positions.ndim >= 2 else 1
    q = torch.randn(b, 2, positions.shape[-1], rope.head_dim, generator=gen)
    k = torch.randn(b, 1, positions.shape[-1], rope.head_dim, generator=gen)
    for got, want in zip(rope.apply(q, k, positions), hf_apply(cfg, q, k, positions, layer_type)):
        assert_close(got, want)


# ------------------------------------------------------------------ Phi-3: the class-level original length
PHI3 = small("phi3", max_position_embeddings=131072, rope_scaling={
    "type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]})


@pytest.mark.parametrize("source", ["dict", "object"])
def test_phi3_without_original_max_uses_the_config_class_default(source):
    """Phi3Config.original_max_position_embeddings = 4096 even when config.json omits it (factor 32 -> af 1.19)."""
    cfg = PHI3 if source == "dict" else hf_config(PHI3)
    rope = posenc.Rope.from_hf_config(cfg)
    assert rope.scaling.original_max_positions == 4096
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-12)
    assert rope.attention_factor == pytest.approx(1.19024, abs=1e-5)
    assert_parity(PHI3, rope, torch.tensor([0, 1, 4095, 4096, 5000]))  # long factors past 4096
    assert_parity(PHI3, rope, torch.tensor([0, 7, 4095]))  # short factors


def test_phi3_original_max_inside_rope_scaling():
    """transformers reads only the top-level value (default 4096): a different inner one is refused, an equal one read."""
    other = {**PHI3, "rope_scaling": {**PHI3["rope_scaling"], "original_max_position_embeddings": 2048}}
    with pytest.raises(PosencError, match=r"config\['rope_scaling'\]\['original_max_position_embeddings'\]: "
                                          r"expected 4096, the top-level .*got 2048"):
        posenc.Rope.from_hf_config(other)
    top = {**other, "original_max_position_embeddings": 2048}  # the top-level key agrees: no ambiguity
    rope = posenc.Rope.from_hf_config(top)
    assert rope.scaling.original_max_positions == 2048
    assert_parity(top, rope, torch.tensor([0, 2047, 2048, 3000]))
    same = {**PHI3, "rope_scaling": {**PHI3["rope_scaling"], "original_max_position_embeddings": 4096}}
    assert posenc.Rope.from_hf_config(same) == posenc.Rope.from_hf_config(PHI3)


# ------------------------------------------------------------------ per-layer RoPE
OLMO3 = small("olmo3", rope_theta=12345.0)


def test_olmo3_v4_theta_reaches_only_full_layers():
    """transformers 5.x gives OLMo 3's sliding layers 500000 whatever 4.x rope_theta says (4.x gave them rope_theta):
    the dict path refuses to guess for sliding layers; the config object, already resolved, is read as it is."""
    full = posenc.Rope.from_hf_config(OLMO3, layer_type="full_attention")
    assert full.base == 12345.0
    assert_parity(OLMO3, full, torch.tensor([0, 3, 900]), "full_attention")
    for layer_type in ("sliding_attention", None):
        with pytest.raises(PosencError, match=r"config\['rope_theta'\]: expected 500000.0 or 5.x rope_parameters .*"
                                              r"sliding-window layers of olmo3.*got 12345.0"):
            posenc.Rope.from_hf_config(OLMO3, layer_type=layer_type)
    obj = hf_config(OLMO3)
    sliding = posenc.Rope.from_hf_config(obj, layer_type="sliding_attention")
    assert sliding.base == 500000.0
    assert_parity(obj, sliding, torch.tensor([0, 3, 900]), "sliding_attention")
    assert posenc.Rope.from_hf_config(obj, layer_type="full_attention") == full
    with pytest.raises(PosencError, match=r"layer_type: expected one of \['full_attention', 'sliding_attention'\] "
                                          r"\(this olmo3 config applies a different RoPE per layer type"):
        posenc.Rope.from_hf_config(obj)
    default = small("olmo3", rope_theta=500000.0)  # the usual checkpoint: both paths agree on every layer
    assert posenc.Rope.from_hf_config(default) == posenc.Rope.from_hf_config(hf_config(default))


PER_LAYER = {
    "olmo3-yarn": small("olmo3", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    "gemma3": small("gemma3_text", head_dim=16, num_hidden_layers=7, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "cohere2": small("cohere2", rope_theta=5e4),
    "exaone4": small("exaone4"),
}


@pytest.mark.parametrize("name", sorted(PER_LAYER))
@pytest.mark.parametrize("source", ["dict", "object"])
def test_per_layer_models_make_the_caller_choose(name, source):
    cfg = PER_LAYER[name] if source == "dict" else hf_config(PER_LAYER[name])
    with pytest.raises(PosencError, match=r"layer_type: expected one of \['full_attention', 'sliding_attention'\] "
                                          r"\(this \w+ config applies a different RoPE per layer type: full_attention: "):
        posenc.Rope.from_hf_config(cfg)


def _transformers_layers(cfg):
    """Per layer, (rotates?, layer type) from transformers' own model modules (tiny random weights)."""
    import transformers

    config = hf_config(cfg)
    model = transformers.AutoModel.from_config(config)
    out = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        if hasattr(attn, "use_rope"):  # SmolLM3
            rotates = bool(attn.use_rope)
        elif config.model_type == "cohere2":
            rotates = attn.sliding_window is not None
        elif config.model_type == "exaone4":
            rotates = attn.sliding_window is None or attn.is_sliding
        else:
            rotates = True
        out.append((rotates, config.layer_types[i] if getattr(config, "layer_types", None) else None))
    return out


@pytest.mark.parametrize("cfg", [
    small("smollm3", num_hidden_layers=9), small("smollm3", num_hidden_layers=6, no_rope_layer_interval=3),
    small("cohere2", num_hidden_layers=5), small("exaone4", num_hidden_layers=5),
    small("exaone4", num_hidden_layers=3, sliding_window=None, layer_types=["full_attention"] * 3),
    small("gemma3_text", head_dim=16, num_hidden_layers=7), small("olmo3", num_hidden_layers=5),
    small("cohere2", num_hidden_layers=3, sliding_window=None)],  # no window: no layer of Cohere 2 rotates
    ids=lambda c: f"{c['model_type']}-{c['num_hidden_layers']}")
def test_layer_ropes_follow_transformers_modules(cfg):
    """One entry per layer: None exactly where transformers' attention applies no rotary embedding; the rest
    rotate as transformers' rotary module for that layer's type."""
    ropes = layer_ropes(cfg)
    expected = _transformers_layers(cfg)
    assert [r is not None for r in ropes] == [rotates for rotates, _ in expected]
    for rope, (rotates, layer_type) in zip(ropes, expected):
        if rotates:
            assert_parity(cfg, rope, torch.tensor([0, 5, 3000]), layer_type)
    assert layer_ropes(hf_config(cfg)) == ropes


def test_cohere2_without_window_has_no_rope():
    with pytest.raises(PosencError, match=r"config: expected a model that applies RoPE somewhere .*got sliding_window=None"):
        posenc.Rope.from_hf_config(small("cohere2", sliding_window=None))


def test_smollm3_nope_layers_refused_without_a_choice():
    with pytest.raises(PosencError, match=r"config\['no_rope_layers'\]: expected every layer to apply RoPE .*"
                                          r"layers \[3, 7\]: use posenc.hf.layer_ropes"):
        posenc.Rope.from_hf_config(small("smollm3", num_hidden_layers=9))


@pytest.mark.parametrize("model_type", ["gemma3_text", "olmo3"])
def test_legacy_type_key_of_per_layer_models(model_type):
    """transformers merges rope_scaling into a dict that already says rope_type='default', so a legacy
    `type` is silently ignored there: both paths refuse to build the full-attention RoPE."""
    cfg = small(model_type, head_dim=16, num_hidden_layers=7, rope_scaling={"type": "linear", "factor": 4.0})
    for layer_type in ("full_attention", None):
        with pytest.raises(PosencError, match=r"config\['rope_scaling'\]\['type'\]: expected 'rope_type' .*silently "
                                              r"run unscaled\), got 'linear'"):
            posenc.Rope.from_hf_config(cfg, layer_type=layer_type)
        with pytest.raises(PosencError, match=r"\['full_attention'\]\['type'\]: expected the same rope type as "
                                              r"rope_type='default'"):
            posenc.Rope.from_hf_config(hf_config(cfg), layer_type=layer_type)
    sliding = posenc.Rope.from_hf_config(cfg, layer_type="sliding_attention")  # unaffected layers still build
    assert sliding == posenc.Rope.from_hf_config(hf_config(cfg), layer_type="sliding_attention")
    assert_parity(cfg, sliding, torch.tensor([0, 9, 2000]), "sliding_attention")
    modern = small(model_type, head_dim=16, num_hidden_layers=7, rope_scaling={"rope_type": "linear", "factor": 4.0})
    full = posenc.Rope.from_hf_config(modern, layer_type="full_attention")
    assert full.scaling == posenc.Linear(4.0)
    assert_parity(modern, full, torch.tensor([0, 9, 2000]), "full_attention")


# ------------------------------------------------------------------ YaRN's `or` defaults
@pytest.mark.parametrize("source", ["dict", "object"])
def test_yarn_zero_betas_mean_the_defaults(source):
    """transformers reads `beta_fast or 32`, `beta_slow or 1`: an explicit 0 is the default, not a zero."""
    cfg = small("llama", rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                                       "beta_fast": 0, "beta_slow": 0})
    rope = posenc.Rope.from_hf_config(cfg if source == "dict" else hf_config(cfg))
    assert (rope.scaling.beta_fast, rope.scaling.beta_slow) == (32.0, 1.0)
    assert_parity(cfg, rope, torch.tensor([0, 100, 4000]))


# ------------------------------------------------------------------ Qwen2-VL: never interleaved
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vl_ignores_mrope_interleaved(model_type):
    cfg = small(model_type, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    rope = posenc.Rope.from_hf_config(cfg)
    assert rope.mrope_interleaved is False
    t = torch.tensor([[0, 1, 2, 3, 3, 3, 9, 10]])
    pos = torch.stack([t, t.clamp(max=3) + torch.tensor([0, 0, 0, 0, 1, 2, 0, 0]), t.clamp(max=3) + 2 * (t > 5)])
    assert_parity(cfg, rope, pos)  # [3, b=1, t=8], the three axes differ


# ------------------------------------------------------------------ head_dim, derived once
WIDTH_TYPES = sorted(t for t, c in MODEL_TYPES.items() if c.rope_width is None and c.refused is None)
FITS = {"gptj": {"rotary_dim": 8}, "codegen": {"rotary_dim": 8}, "smollm3": {"num_hidden_layers": 3},
        "cohere2_moe": {"num_hidden_layers": 54}, "zamba2": {"num_hidden_layers": 54, "use_mem_rope": True},
        "granitemoehybrid": {"position_embedding_type": "rope", "mamba_n_heads": 2, "layer_types": ["mamba", "attention"] * 2}, "moonshine": {"hidden_size": 160},
        "moonshine_streaming": {"hidden_size": 160},
}  # widths and layers these small sizes allow


@pytest.mark.parametrize("model_type", WIDTH_TYPES)
def test_head_dim_as_the_config_class_derives_it(model_type):
    """Without `head_dim` in config.json: the config class's value (Qwen3 128, Gemma 256, ...) everywhere:
    hf.head_dim, the KV-cache facts `posenc inspect` prints, and the Rope's width."""
    cfg = small(model_type, **{"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                               **FITS.get(model_type, {})})
    text = getattr(hf_config(cfg), "text_config", None) or hf_config(cfg)
    if text.hidden_size != cfg["hidden_size"]:  # a composite class that keeps its text_config's own sizes for a
        pytest.skip("flat dict (posenc reads a flat dict's sizes as the language model's)")
    want = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if MODEL_TYPES[model_type].mrope:  # M-RoPE sections that fit this width (the modeling defaults need 128)
        pairs = want // 2
        cfg["rope_scaling"] = {"rope_type": "default", "mrope_section": [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3]}
    assert head_dim(cfg) == want
    assert kv_cache_facts(cfg).head_dim == want
    if model_type in ("llama4", "llama4_text"):  # NoPE layers: one Rope or None per layer
        assert {r.head_dim for r in layer_ropes(cfg) if r is not None} == {want}
    elif model_type not in ("cohere2", "cohere2_moe", "exaone4"):  # per-layer models: asked per layer type below
        assert posenc.Rope.from_hf_config(cfg).head_dim == want
    else:
        assert posenc.Rope.from_hf_config(cfg, layer_type="sliding_attention").head_dim == want


def test_kv_facts_of_qwen3_and_gemma_without_head_dim():
    assert kv_cache_facts(small("qwen3", hidden_size=256)).head_dim == 128  # not 256 / 4 = 64
    assert kv_cache_facts(small("gemma", hidden_size=768, num_attention_heads=4)).head_dim == 256  # not 192


# ------------------------------------------------------------------ sliding-window layer patterns
@pytest.mark.parametrize("cfg", [
    small("gemma2", head_dim=16, num_hidden_layers=5, sliding_window=3),
    small("gemma3_text", head_dim=16, num_hidden_layers=13, sliding_window=3),
    small("gemma3_text", head_dim=16, num_hidden_layers=5, sliding_window=3, sliding_window_pattern=2),
    small("cohere2", num_hidden_layers=9, sliding_window=3),
    small("olmo3", num_hidden_layers=9, sliding_window=3),
    small("gpt_oss", head_dim=16, num_hidden_layers=5, sliding_window=3),
    small("qwen2", num_hidden_layers=5, sliding_window=3, use_sliding_window=True, max_window_layers=2),
    small("qwen2", num_hidden_layers=5, sliding_window=3),  # use_sliding_window defaults to false: no window
    small("qwen3", num_hidden_layers=5, sliding_window=3, use_sliding_window=True, max_window_layers=3),
    small("qwen2_moe", num_hidden_layers=7, sliding_window=3, use_sliding_window=True, max_window_layers=5),
    small("qwen3_moe", num_hidden_layers=3, sliding_window=3, use_sliding_window=True),
    small("mistral", num_hidden_layers=3, sliding_window=3)],
    ids=lambda c: f"{c['model_type']}-{c['num_hidden_layers']}-{c.get('use_sliding_window')}")
def test_layer_windows_follow_the_config_class(cfg):
    """Which layers slide when config.json has no `layer_types`, as transformers' config class decides."""
    config = hf_config(cfg)
    types = getattr(config, "layer_types", None)
    if types is None:  # every layer takes config.sliding_window (Qwen3-MoE, Mistral)
        want = (config.sliding_window,) * cfg["num_hidden_layers"]
    else:
        want = tuple(config.sliding_window if t == "sliding_attention" else None for t in types)
    assert layer_windows(cfg) == want
    assert layer_windows(config) == want


def test_gemma2_even_layers_slide():
    assert layer_windows(small("gemma2", head_dim=16, num_hidden_layers=5, sliding_window=3)) == (3, None, 3, None, 3)
