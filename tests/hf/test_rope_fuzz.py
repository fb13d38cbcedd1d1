"""Random configs against transformers' own rotary embedding classes (hypothesis, bounded and derandomized).

Each example draws a model type, 4.x keys (`rope_theta`, `rope_scaling` with `type` or `rope_type`) or 5.x keys
(`rope_parameters`), a scaling with random knobs (linear, dynamic, yarn, longrope, llama3, default), head sizes
(sometimes without `head_dim`, so the config class's default applies), partial rotary factors and positions,
and reads it as a dict and as transformers' `PretrainedConfig`. Then:

- transformers builds it: posenc builds the same `Rope` from both forms, and its cos/sin tables (attention factor
  applied) and inverse frequencies equal those of a fresh transformers rotary module bit for bit, except
  DeepSeek-V2 (complex polar form, within 5e-7) and GPT-J (its own float32 table formula, TOL[float32]);
- transformers refuses it: posenc refuses too (PosencError);
- posenc refuses what transformers accepts only for the deliberate differences in `DELIBERATE` (transformers
  only warns, or silently ignores a key), each matched by its message; and it reads Mixtral's `head_dim=None`
  as hidden / heads (as transformers' attention does) where transformers' scaled rotary classes crash.
"""

import copy
import re

import pytest
import torch
from tests.helpers.tolerances import TOL

pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import posenc  # noqa: E402
from tests.helpers.hf_oracle import _modeling, _rotary_class, _text, hf_apply, hf_config  # noqa: E402
from posenc import PosencError  # noqa: E402

# posenc refuses, transformers accepts (it warns, or computes a table its attention then cannot apply)
DELIBERATE = {
    "beta order": r"\['beta_fast'\]: expected a value greater than beta_slow",  # transformers warns
    "non-positive factor": r"\['factor'\]: expected a finite number > 0",  # transformers warns, tables inf / nan
    "unknown key": r"expected one of the keys of rope_type",  # transformers warns and ignores it
    "partial on a whole-head family": r"partial_rotary_factor'\]: expected 1.0 for \w+ with rope_type",
    "odd partial width": r"expected a fraction giving an even, non-zero rotary width",
    "legacy type, per-layer model": r"\['type'\]: expected 'rope_type' \(\w+ merges rope_scaling",  # ignored there
    "OLMo-3 4.x theta": r"config\['rope_theta'\]: expected 500000.0 or 5.x rope_parameters",  # 4.x and 5.x differ
    "Phi-3 inner L0": r"\['original_max_position_embeddings'\]: expected \d+, the top-level",  # ignored there
    "GPT-J scaling or theta": r"(\['rope_type'\]: expected one of \('default',\)|gptj's table is fixed)",  # ignored
}
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

# model type -> (pairs its rotary output as "cat" | "interleaved" | "pairs" | "complex", per-layer types or None)
FAMILIES = {
    "llama": "cat", "mistral": "cat", "qwen2": "cat", "qwen3": "cat", "olmo2": "cat", "granite": "cat",
    "mixtral": "cat", "gemma": "cat", "phi": "cat", "phi3": "cat", "stablelm": "cat", "gpt_neox": "cat",
    "persimmon": "cat", "glm": "cat", "deepseek_v3": "cat", "qwen2_vl": "cat", "falcon": "cat", "starcoder2": "cat",
    "gemma3_text": "cat", "olmo3": "cat", "smollm3": "cat", "cohere": "interleaved", "gpt_oss": "pairs",
    "gptj": "pairs", "deepseek_v2": "complex",
}
PER_LAYER = {"gemma3_text", "olmo3"}
SCALINGS = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@st.composite
def configs(draw, model_types=tuple(sorted(FAMILIES))):
    model_type = draw(st.sampled_from(model_types))
    heads = draw(st.integers(1, 4))
    head = draw(st.sampled_from([8, 12, 16, 24, 32]))
    max_pos = draw(st.sampled_from([64, 256, 1024]))
    cfg = {"model_type": model_type, "hidden_size": heads * head, "num_attention_heads": heads,
           "num_key_value_heads": heads, "max_position_embeddings": max_pos, "num_hidden_layers": 3}
    if (draw(st.booleans()) or model_type in ("qwen3", "gemma", "gemma3_text", "glm", "gpt_oss")) and model_type != "falcon":
        cfg["head_dim"] = head  # otherwise hidden / heads, or the class default where there is one (drawn rarely)
    if model_type in PER_LAYER:
        cfg["num_hidden_layers"] = 8
    if model_type in ("deepseek_v2", "deepseek_v3"):
        cfg.update(qk_rope_head_dim=head, rope_interleave=draw(st.booleans()))
    rope_width = head
    if model_type == "gptj":
        cfg["rotary_dim"] = draw(st.sampled_from([r for r in (4, 8, 16) if r <= head]))
    elif model_type == "gpt_neox" and draw(st.booleans()):
        cfg["rotary_pct"] = draw(st.sampled_from([0.25, 0.5, 1.0]))
    elif model_type not in ("gpt_neox", "gptj", "qwen2_vl") and draw(st.integers(0, 3)) == 0:
        cfg["partial_rotary_factor"] = draw(st.sampled_from([0.25, 0.5, 0.75, 1.0]))
    kind = draw(st.sampled_from(("default", "longrope") if model_type == "phi3" else SCALINGS))  # gptj: all refused
    params = {"rope_type": kind}
    half = rope_width * (cfg.get("partial_rotary_factor") or (0.5 if model_type in ("phi", "glm", "persimmon")
                                                              else 0.25 if model_type in ("gpt_neox", "stablelm") else 1)) // 2
    half = int(cfg.get("rotary_pct", 1) * rope_width) // 2 if model_type == "gpt_neox" and "rotary_pct" in cfg else int(half)
    if kind in ("linear", "dynamic", "yarn", "llama3"):
        params["factor"] = draw(st.sampled_from([1.0, 1.5, 2.0, 4.0, 8.0, 32.0]))
    if kind in ("yarn", "longrope", "llama3") and draw(st.booleans()):
        params["original_max_position_embeddings"] = max_pos // draw(st.sampled_from([1, 2, 4]))
    if kind == "yarn":
        for key, values in (("beta_fast", [0, 2, 8, 16, 32, 48.5]), ("beta_slow", [0, 1, 2, 4]),
                            ("mscale", [0.5, 0.707, 1.0]), ("mscale_all_dim", [0, 0.707, 1.0]),
                            ("attention_factor", [0.8, 1.0, 1.25]), ("truncate", [True, False])):
            if draw(st.integers(0, 2)) == 0:
                params[key] = draw(st.sampled_from(values))
    if kind == "longrope":
        factors = st.lists(st.sampled_from([1.0, 1.25, 2.0, 3.5, 8.0]), min_size=half, max_size=half)
        params.update(short_factor=draw(factors), long_factor=draw(factors))
        if draw(st.booleans()):
            params["attention_factor"] = draw(st.sampled_from([1.0, 1.1, 1.4]))
        if model_type == "phi3" and draw(st.booleans()):
            cfg["original_max_position_embeddings"] = max_pos // 4
    if kind == "llama3":
        params.update(low_freq_factor=draw(st.sampled_from([1.0, 2.0])), high_freq_factor=draw(st.sampled_from([4.0, 8.0])))
    if model_type == "phi3" and kind == "longrope" and draw(st.integers(0, 3)) == 0:
        params["original_max_position_embeddings"] = draw(st.sampled_from([max_pos // 4, 4096]))
    broken = draw(st.integers(0, 14))  # 3 in 15: a config transformers refuses or only warns about
    if broken == 0 and "factor" in params:
        params["factor"] = draw(st.sampled_from([0.0, -2.0]))
    elif broken == 1 and kind != "default":
        params.pop(draw(st.sampled_from(sorted(k for k in params if k != "rope_type"))))
    elif broken == 2:
        params["rope_thetha"] = 10000.0  # a typo
    if model_type == "qwen2_vl":
        t = draw(st.integers(0, half))
        h = draw(st.integers(0, half - t))
        params["mrope_section"] = [t, h, half - t - h]
    theta = draw(st.sampled_from([None, 10000.0, 500000.0, 1e6]))
    v5 = draw(st.booleans())
    if v5:
        if theta is not None:
            params["rope_theta"] = theta
        if model_type in PER_LAYER:
            local = {"rope_type": "default", "rope_theta": draw(st.sampled_from([10000.0, 500000.0]))}
            params.setdefault("rope_theta", 1e6)
            params = {"full_attention": params, "sliding_attention": local}
        cfg["rope_parameters"] = params
    else:
        if theta is not None:
            cfg["gpt_neox" == model_type and "rotary_emb_base" or "rope_theta"] = theta
        if kind != "default" or model_type == "qwen2_vl":
            if draw(st.booleans()):
                params["type"] = params.pop("rope_type")  # the legacy key
            cfg["rope_scaling"] = params
        if model_type == "gemma3_text" and draw(st.booleans()):
            cfg["rope_local_base_freq"] = draw(st.sampled_from([10000.0, 20000.0]))
    layer_type = draw(st.sampled_from(["full_attention", "sliding_attention"])) if model_type in PER_LAYER else None
    return cfg, layer_type


@st.composite
def positions(draw, cfg):
    top = 3 * cfg["max_position_embeddings"]
    if cfg["model_type"] == "gptj":
        top = cfg["max_position_embeddings"] - 1  # GPT-J's table has max_position_embeddings rows
    b, t = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    rows = [[draw(st.integers(0, top)) for _ in range(t)] for _ in range(b)]
    pos = torch.tensor(rows)  # [b, t]
    if cfg["model_type"] == "qwen2_vl":
        pos = torch.stack([pos, pos // 2, (pos * 3) % (top + 1)])  # [3, b, t], three different axes
    return pos


def transformers_tables(config, layer_type, pos):
    """(cos, sin) per pair `[b, t, r/2]` and inv_freq from a fresh transformers rotary module; None if it refuses."""
    text = _text(config)
    module = _modeling(text.model_type)
    rotary = _rotary_class(module)(text)
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        out = rotary(x, pos, layer_type) if text.model_type in PER_LAYER else rotary(x, pos)
    family = FAMILIES[config.model_type]
    prefix = f"{layer_type}_" if text.model_type in PER_LAYER else ""
    inv = getattr(rotary, f"{prefix}inv_freq", None)
    if family == "complex":
        return out.real, out.imag, inv
    first, second = out
    if text.model_type == "gptj":
        first, second = second, first  # GPT-J returns (sin, cos)
    if family == "cat":
        r = first.shape[-1] // 2
        first, second = first[..., :r], second[..., :r]
    elif family == "interleaved":
        first, second = first[..., ::2], second[..., ::2]
    return first, second, inv


def _null_head_dim_crash(cfg):
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type"))
    return cfg["model_type"] in ("mixtral", "ministral") and cfg.get("head_dim") is None and kind in (
        "dynamic", "yarn", "longrope")


def run(cfg, layer_type, pos):
    config = None
    try:
        config = hf_config(cfg)
        want = transformers_tables(config, layer_type, pos)
    except Exception as e:  # noqa: BLE001 - transformers refuses in many ways (ValueError, KeyError, TypeError ...)
        if _null_head_dim_crash(cfg):
            # Mixtral / Ministral keep head_dim=None; transformers' dynamic, yarn and longrope then crash on
            # `getattr(config, "head_dim", ...)`, its attention uses hidden / heads: posenc reads it as its attention
            try:
                rope = posenc.Rope.from_hf_config(cfg, layer_type=layer_type)
            except PosencError as refused:
                assert any(re.search(p, str(refused)) for p in DELIBERATE.values()), f"{refused}\n{cfg}"
                return "deliberate: refused for another reason"
            assert rope.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
            return "deliberate: head_dim None read as hidden / heads"
        # transformers builds every layer type at once; posenc reads the one asked for, so with per-layer RoPE
        # the whole model (layer_type=None) is what must be refused
        with pytest.raises(PosencError):
            posenc.Rope.from_hf_config(cfg, layer_type=None if cfg["model_type"] in PER_LAYER else layer_type)
        return f"both refuse ({type(e).__name__})"
    try:
        rope = posenc.Rope.from_hf_config(cfg, layer_type=layer_type)
    except PosencError as e:
        reasons = [k for k, pattern in DELIBERATE.items() if re.search(pattern, str(e))]
        assert reasons, f"posenc refuses what transformers accepts: {e}\n{cfg}"
        return f"deliberate: {reasons[0]}"
    assert posenc.Rope.from_hf_config(config, layer_type=layer_type) == rope, "dict and config object differ"
    cos, sin = rope.cos_sin(pos)  # [b, t, r/2]
    seq_len = int(pos.max()) + 1
    inv, _ = rope.inv_freq(seq_len)
    model_type = cfg["model_type"]
    for name, got, expected in (("cos", cos, want[0]), ("sin", sin, want[1]), ("inv_freq", inv, want[2])):
        if expected is None or (name == "inv_freq" and model_type == "gptj"):
            continue
        expected = expected.to(got.dtype).expand_as(got)
        if model_type == "deepseek_v2":  # complex polar form: cos/sin from torch.polar, ~5e-7 apart
            torch.testing.assert_close(got, expected, atol=5e-7, rtol=0, msg=f"{name} {cfg}")
        elif model_type == "gptj":
            torch.testing.assert_close(got, expected, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])
        else:
            assert torch.equal(got, expected), f"{name}: max diff {(got - expected).abs().max()} for {cfg} at {pos}"
    gen = torch.Generator().manual_seed(0)  # the rotation too: pairing, partial width, DeepSeek's layouts
    q = torch.randn(pos.shape[-2], 2, pos.shape[-1], rope.head_dim, generator=gen)  # [b, hq, t, d]
    k = torch.randn(pos.shape[-2], 1, pos.shape[-1], rope.head_dim, generator=gen)  # [b, hk, t, d]
    for got, expected in zip(rope.apply(q, k, pos), hf_apply(config, q, k, pos, layer_type)):
        torch.testing.assert_close(got, expected, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])
    return "equal"


OUTCOMES: dict[str, int] = {}


@SETTINGS
@given(data=st.data())
def test_random_configs_match_transformers(data):
    cfg, layer_type = data.draw(configs())
    pos = data.draw(positions(cfg))
    outcome = run(copy.deepcopy(cfg), layer_type, pos)
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1


SCALED = tuple(t for t in sorted(FAMILIES) if t not in ("gptj", "phi3"))  # every rope type applies


@SETTINGS
@given(data=st.data())
def test_random_scaled_configs_of_the_main_families(data):
    """A second, denser draw over the families that take every scaling (more yarn / longrope / llama3 knobs)."""
    cfg, layer_type = data.draw(configs(model_types=("llama", "qwen2", "deepseek_v3", "gpt_oss", "olmo3", "phi")))
    pos = data.draw(positions(cfg))
    outcome = run(copy.deepcopy(cfg), layer_type, pos)
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1


def test_fuzz_exercised_agreement():
    """The draws above are not vacuous: most end in bit-equal tables (run in file order, after both fuzz tests)."""
    if not OUTCOMES:
        pytest.skip("run together with the fuzz tests")
    assert OUTCOMES.get("equal", 0) >= 100, OUTCOMES

