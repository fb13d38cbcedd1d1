"""The only module that knows transformers' config keys and model-type conventions.

`rope_from_hf_config(cfg)` reads a `config.json` dict or a `PretrainedConfig` (transformers 4.x keys:
`rope_theta`, `rope_scaling` with `type` or `rope_type`; 5.x keys: `rope_parameters`, possibly nested
per layer type) and returns the `posenc.Rope` that transformers 5.x applies for that model type.
Ambiguous or inconsistent configs are refused with a `PosencError` where transformers only warns.

    >>> rope = rope_from_hf_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    ...                             "rope_theta": 500000.0})
    >>> rope.head_dim, rope.rotary_dim, rope.base, rope.pairing
    (16, 16, 500000.0, 'split_half')
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import PosencError, Raw, check_positive, fail
from ..rope import scaling as sc
from ..rope.spec import Rope

__all__ = ["rope_from_hf_config", "config_to_dict", "text_config", "MODEL_TYPES", "ROPE_TYPES", "NON_ROPE_MODEL_TYPES"]


@dataclass(frozen=True)
class Convention:
    """How one model family applies RoPE in transformers 5.x."""

    pairing: str = "split_half"
    default_theta: float = 10000.0
    partial: float | None = None  # default partial_rotary_factor; None: the default rope rotates the whole head
    head_dim: int | None = None  # the config class's head_dim when config.json omits it (else hidden / heads)
    mrope: bool = False  # Qwen2-VL family: mrope_section over [3, b, t] positions
    local_theta: tuple[str, float] | None = None  # per-layer models: 4.x key and default of the sliding-layer theta
    nope_layer: str | None = None  # a layer type that applies no RoPE at all
    default_params: tuple[tuple[str, Any], ...] = ()  # the config class's rope parameters when config.json has none


_LLAMA = Convention()
_GLM = Convention(pairing="interleaved", partial=0.5, head_dim=128)
_QWEN_VL = Convention(default_theta=1_000_000.0, mrope=True)
_GEMMA3 = Convention(default_theta=1_000_000.0, head_dim=256, local_theta=("rope_local_base_freq", 10000.0))
MODEL_TYPES: dict[str, Convention] = {
    **dict.fromkeys(
        ("llama", "mistral", "ministral", "qwen2", "qwen2_moe", "qwen3_moe", "olmo", "olmo2", "starcoder2",
         "granite", "falcon"),
        _LLAMA,
    ),
    "mixtral": Convention(default_theta=1_000_000.0),
    "qwen3": Convention(head_dim=128),
    "gemma": Convention(head_dim=256),
    "gemma2": Convention(head_dim=256),
    "gemma3": _GEMMA3,
    "gemma3_text": _GEMMA3,
    "olmo3": Convention(default_theta=500000.0, local_theta=("rope_theta", 500000.0)),
    "smollm3": Convention(default_theta=2_000_000.0),
    "exaone4": Convention(nope_layer="full_attention"),  # only when sliding_window is set, see _check_layer
    "gpt_oss": Convention(default_theta=150000.0, head_dim=64, default_params=(
        ("rope_type", "yarn"), ("factor", 32.0), ("beta_fast", 32.0), ("beta_slow", 1.0), ("truncate", False),
        ("original_max_position_embeddings", 4096))),
    "phi": Convention(partial=0.5),
    "phi3": Convention(partial=1.0),
    "stablelm": Convention(partial=0.25),
    "persimmon": Convention(partial=0.5),
    "gpt_neox": Convention(partial=0.25),
    "gptj": Convention(pairing="interleaved"),
    "cohere": Convention(pairing="interleaved", default_theta=500000.0),
    "cohere2": Convention(pairing="interleaved", nope_layer="full_attention"),
    "glm": _GLM,
    "glm4": _GLM,
    "deepseek_v2": Convention(pairing="interleaved"),
    "deepseek_v3": Convention(pairing="interleaved_to_split_half"),
    "qwen2_vl": _QWEN_VL,
    "qwen2_vl_text": _QWEN_VL,
    "qwen2_5_vl": _QWEN_VL,
    "qwen2_5_vl_text": _QWEN_VL,
}

_ALIBI = "ALiBi (posenc.alibi_slopes / posenc.alibi_bias)"
_LEARNED = "learned absolute position embeddings"
_T5 = "T5 relative position buckets (posenc.t5_relative_position_bucket)"
NON_ROPE_MODEL_TYPES = {
    **dict.fromkeys(("bloom", "mpt"), _ALIBI),
    **dict.fromkeys(("t5", "mt5", "umt5", "longt5"), _T5),
    **dict.fromkeys(("gpt2", "gpt_bigcode", "bert", "roberta", "distilbert", "opt", "gpt_neo", "xlm-roberta"), _LEARNED),
}

# Keys a rope-parameter dict may carry, per rope type, beyond the common ones.
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"},
    "longrope": {"short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
_REQUIRED = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor"},
    "longrope": {"short_factor", "long_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
}
ROPE_TYPES = tuple(_KEYS)
_ALIASES = {"mrope": "default", "su": "longrope"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


_MISSING = Raw("nothing (key missing)")


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain dict from a config.json dict or a transformers `PretrainedConfig`."""
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if config is None or not callable(to_dict):
        fail("config", "a config.json dict or a transformers PretrainedConfig", type(config))
    out = dict(to_dict())
    for key in ("head_dim", "rope_parameters", "model_type"):  # properties to_dict() may not serialise
        if key not in out and getattr(config, key, None) is not None:
            out[key] = getattr(config, key)
    return out


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Vision-language configs keep the language model's facts in `text_config`."""
    text = cfg.get("text_config")
    if not (isinstance(text, Mapping) or hasattr(text, "to_dict")):
        return cfg
    merged = config_to_dict(text)
    for key, value in cfg.items():
        if key != "text_config":
            merged.setdefault(key, value)
    if cfg.get("model_type"):
        merged["model_type"] = cfg["model_type"]
    return merged


def positive_int(cfg: Mapping[str, Any], key: str, where: str = "config") -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or int(value) != value:
        fail(f"{where}['{key}']", "a positive integer", value if key in cfg else _MISSING)
    return int(value)


def present_key(cfg: Mapping[str, Any], *keys: str) -> str:
    """The first of several alias keys present in cfg (transformers' attribute_map), else the first name."""
    return next((k for k in keys if cfg.get(k) is not None), keys[0])


def _rope_type(params: Mapping[str, Any], where: str, model_type: str) -> str:
    aliases = dict(_ALIASES, yarn="longrope") if model_type == "phi3" else _ALIASES  # Phi-3's legacy names
    raw = [params.get("rope_type"), params.get("type")]
    for key, value in zip(("rope_type", "type"), raw):
        if value is not None and not isinstance(value, str):
            fail(f"{where}['{key}']", f"a rope type name, one of {ROPE_TYPES}", value)
    t1, t2 = (aliases.get(t, t) if t is not None else None for t in raw)
    if t1 is not None and t2 is not None and t1 != t2:
        fail(f"{where}['type']", f"the same rope type as rope_type={raw[0]!r} (or no 'type' key)", raw[1])
    name = t1 or t2 or "default"
    if name not in _KEYS:
        fail(f"{where}['rope_type']", f"one of the known rope types {ROPE_TYPES}", raw[0] or raw[1])
    if model_type == "phi3" and name not in ("default", "longrope"):
        fail(f"{where}['rope_type']", "'default' or 'longrope' (the only ones Phi-3 accepts)", name)
    return name


def _check_keys(params: Mapping[str, Any], rope_type: str, where: str) -> None:
    allowed = _COMMON | _KEYS[rope_type]
    for key, value in params.items():
        if key in allowed or value is None:
            continue
        owners = [t for t, keys in _KEYS.items() if key in keys]
        if owners:
            fail(f"{where}['{key}']", f"no such key for rope_type {rope_type!r} (it belongs to {owners})", value)
        fail(f"{where}['{key}']", f"one of the keys of rope_type {rope_type!r}: {sorted(allowed)}", key)
    for key in sorted(_REQUIRED[rope_type]):
        if params.get(key) is None:
            fail(f"{where}['{key}']", f"a value (required for rope_type {rope_type!r})", _MISSING)


def _layer_params(cfg: dict[str, Any], conv: Convention) -> tuple[dict[str, Any], str]:
    """`({layer_type or None: params or None}, where)`: the rope-parameter dict(s) the model reads."""
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, Mapping):
            fail(f"config['{key}']", "a dict of rope parameters or null", value)
    nested_keys = set(_LAYER_TYPES) | set(cfg.get("layer_types") or [])
    nested = bool(params) and all(k in nested_keys for k in params)
    if not nested and not conv.local_theta:
        chosen = dict(scaling or params or conv.default_params)
        return {None: chosen}, "rope_scaling" if scaling else "rope_parameters"
    # Per-layer RoPE (Gemma 3, OLMo 3): 5.x nests the dicts; 4.x has rope_scaling for full-attention layers
    # and a separate theta for sliding ones.
    layers = {k: (None if v is None else dict(v)) for k, v in (params or {}).items()} if nested else {}
    if scaling:
        layers["full_attention"] = {**(layers.get("full_attention") or {}), **scaling}
    if conv.local_theta:
        layers.setdefault("full_attention", {}).setdefault("rope_theta", cfg.get("rope_theta"))
        key, default = conv.local_theta
        local = cfg.get(key, default) if not nested else default
        sliding = layers.setdefault("sliding_attention", {"rope_type": "default"})
        if sliding is not None:
            sliding.setdefault("rope_theta", default if local is None else local)
    return layers, "rope_parameters"


def _head_dim(cfg: Mapping[str, Any], model_type: str, conv: Convention) -> int:
    if model_type in ("deepseek_v2", "deepseek_v3"):  # MLA: RoPE runs on the qk_rope_head_dim slice only
        return positive_int(cfg, "qk_rope_head_dim") if "qk_rope_head_dim" in cfg else 64
    if model_type != "falcon":  # Falcon's head_dim is a property: hidden_size // num_attention_heads
        if cfg.get("head_dim") is not None:
            return positive_int(cfg, "head_dim")
        if "head_dim" not in cfg and conv.head_dim is not None:
            return conv.head_dim  # the config class's default, not hidden / heads
    hidden_key = present_key(cfg, "hidden_size", "n_embd", "n_embed", "d_model")
    heads_key = present_key(cfg, "num_attention_heads", "n_head", "n_heads")
    hidden, heads = positive_int(cfg, hidden_key), positive_int(cfg, heads_key)
    if hidden % heads:
        fail(f"config['{hidden_key}']", f"a multiple of {heads_key}={heads} (or an explicit head_dim)", hidden)
    return hidden // heads


def _partial(cfg: Mapping[str, Any], params: Mapping[str, Any], model_type: str, conv: Convention) -> Any:
    """The partial_rotary_factor the model reads (None: it rotates the whole head)."""
    if "partial_rotary_factor" in params:
        return params["partial_rotary_factor"]
    if model_type == "gpt_neox":  # GPT-NeoX reads rotary_pct and ignores a top-level partial_rotary_factor
        return cfg.get("rotary_pct", conv.partial)
    return cfg.get("partial_rotary_factor", conv.partial)


def _rotary_dim(cfg: Mapping[str, Any], params: Mapping[str, Any], rope_type: str, model_type: str,
                conv: Convention, head_dim: int) -> int:
    if model_type == "gptj":
        if "rotary_dim" in cfg and cfg["rotary_dim"] is None:
            fail("config['rotary_dim']", "an integer (GPT-J with rotary_dim=null rotates hidden_size channels)", None)
        return positive_int(cfg, "rotary_dim") if "rotary_dim" in cfg else 64
    factor, where = _partial(cfg, params, model_type, conv), "partial_rotary_factor"
    if factor is None:
        return head_dim
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        fail(where, "a number in (0, 1]", factor)
    if conv.partial is None and rope_type == "default":
        return head_dim  # this family's default rope ignores partial_rotary_factor
    rotary = int(head_dim * factor)  # transformers truncates
    if conv.partial is None and rotary != head_dim:
        fail(where, f"1.0 for {model_type} with rope_type {rope_type!r} (the model rotates the whole head, "
             f"so transformers would fail on a shorter table)", factor)
    if rotary % 2 or rotary == 0:
        fail(where, f"a fraction giving an even, non-zero rotary width of head_dim={head_dim}", Raw(f"{factor} -> {rotary}"))
    return rotary


def _scaling(rope_type: str, p: Mapping[str, Any], cfg: Mapping[str, Any], where: str) -> sc.Scaling:
    def number(key: str, default: Any = None) -> float:
        value = p.get(key, default)
        if value is None:
            fail(f"{where}['{key}']", "a number", _MISSING)
        return check_positive(f"{where}['{key}']", value)

    def original_max() -> int:
        # transformers: a top-level original_max_position_embeddings wins (Phi-3), then the dict's, then max_pos
        for source, name in ((cfg, "config"), (p, where)):
            if source.get("original_max_position_embeddings") is not None:
                return positive_int(source, "original_max_position_embeddings", name)
        return positive_int(cfg, present_key(cfg, "max_position_embeddings", "n_positions"))

    if rope_type == "default":
        return sc.Default()
    if rope_type == "linear":
        return sc.Linear(number("factor"))
    if rope_type == "dynamic":
        return sc.DynamicNTK(number("factor"), positive_int(cfg, present_key(cfg, "max_position_embeddings", "n_positions")))
    if rope_type == "yarn":
        l0 = original_max()
        factor = positive_int(cfg, "max_position_embeddings") / l0 if p.get("factor") is None else number("factor")
        truncate = p.get("truncate", True)
        if not isinstance(truncate, bool):
            fail(f"{where}['truncate']", "true or false", truncate)
        opt = {k: (None if p.get(k) is None else check_positive(f"{where}['{k}']", p[k], allow_zero=True))
               for k in ("mscale", "mscale_all_dim")}
        beta_fast = number("beta_fast") if p.get("beta_fast") else 32.0  # transformers: `or 32`, so 0 means unset
        beta_slow = number("beta_slow") if p.get("beta_slow") else 1.0
        if beta_fast <= beta_slow:
            fail(f"{where}['beta_fast']", f"a value greater than beta_slow={beta_slow}", beta_fast)
        attention = None if p.get("attention_factor") is None else number("attention_factor")
        return sc.YaRN(factor=factor, original_max_positions=l0, beta_fast=beta_fast, beta_slow=beta_slow,
                       attention_factor=attention, truncate=truncate, **opt)
    if rope_type == "longrope":
        l0 = original_max()
        max_pos = cfg.get("max_position_embeddings")
        factor = number("factor", (max_pos / l0) if max_pos else 1.0)
        attention = p.get("attention_factor")
        if attention is None:
            attention = sc.LongRoPE.default_attention_factor(factor, l0)
        for key in ("short_factor", "long_factor"):
            if not isinstance(p[key], (list, tuple)):
                fail(f"{where}['{key}']", "a list of numbers, one per rotation pair", p[key])
        return sc.LongRoPE(short_factor=tuple(p["short_factor"]), long_factor=tuple(p["long_factor"]),
                           original_max_positions=l0,
                           attention_factor=check_positive(f"{where}['attention_factor']", attention))
    low, high = number("low_freq_factor"), number("high_freq_factor")  # llama3
    if low >= high:
        fail(f"{where}['low_freq_factor']", f"a value below high_freq_factor={high}", low)
    return sc.Llama3(factor=number("factor"), low_freq_factor=low, high_freq_factor=high,
                     original_max_positions=original_max())


def _check_layer(cfg: Mapping[str, Any], model_type: str, conv: Convention, layer_type: str | None) -> None:
    """Refuse layer types the config does not have, and layers that apply no RoPE."""
    if layer_type is None:
        return
    known = set(_LAYER_TYPES) | set(cfg.get("layer_types") or [])
    if layer_type not in known:
        fail("layer_type", f"one of {sorted(known)} or None", layer_type)
    nope = conv.nope_layer == layer_type and (model_type != "exaone4" or cfg.get("sliding_window") is not None)
    if nope:
        fail("layer_type", f"a layer type that uses RoPE ({model_type} {layer_type} layers use no positional "
             "encoding)", layer_type)


def _build(cfg: dict[str, Any], model_type: str, conv: Convention, params: dict[str, Any], where: str) -> Rope:
    rope_type = _rope_type(params, where, model_type)
    if model_type == "gptj":  # GPT-J's table is hard-wired: base 10000, no scaling
        params, rope_type = {"rope_theta": 10000.0}, "default"
    _check_keys(params, rope_type, where)
    base = params.get("rope_theta")
    if base is None:
        key = "rotary_emb_base" if model_type == "gpt_neox" else "rope_theta"
        base, where_theta = cfg.get(key), f"config['{key}']"
        base = conv.default_theta if base is None else base
    else:
        where_theta = f"{where}['rope_theta']"
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 0:
        fail(where_theta, "a finite number > 0", base)
    if base == 1:
        fail(where_theta, "a number other than 1 (every frequency would be 1)", base)
    head_dim = _head_dim(cfg, model_type, conv)
    if head_dim % 2:
        fail("head_dim", "an even number of channels (RoPE rotates pairs)", head_dim)
    rotary = _rotary_dim(cfg, params, rope_type, model_type, conv, head_dim)
    scaling = _scaling(rope_type, params, cfg, where)
    pairing = conv.pairing
    if model_type == "deepseek_v3" and cfg.get("rope_interleave", True) is False:
        pairing = "split_half"
    section = None
    if conv.mrope:
        section = params.get("mrope_section", cfg.get("mrope_section")) or [16, 24, 24]  # transformers' default
        if not isinstance(section, (list, tuple)):
            fail(f"{where}['mrope_section']", "a list of 3 integers (t, h, w frequencies)", section)
    softmax = 1.0
    if model_type in ("deepseek_v2", "deepseek_v3") and isinstance(scaling, sc.YaRN):
        softmax = scaling.softmax_scale_factor()
    try:
        return Rope(head_dim=head_dim, rotary_dim=rotary, base=float(base), scaling=scaling, pairing=pairing,
                    mrope_section=None if section is None else tuple(section),
                    mrope_interleaved=bool(params.get("mrope_interleaved", False)), softmax_scale_factor=softmax)
    except PosencError as e:
        raise PosencError(f"{model_type} config: {e}") from None


def rope_from_hf_config(config: Any, *, layer_type: str | None = None) -> Rope:
    """Build the `Rope` that transformers applies for a model config (dict or `PretrainedConfig`).

    Args:
        config: a config.json dict (4.x or 5.x keys; vision-language configs may nest `text_config`) or a
            transformers `PretrainedConfig`.
        layer_type: for per-layer RoPE (Gemma 3, OLMo 3: "full_attention" / "sliding_attention"); needed only
            when the layer types differ.
    Returns:
        A `Rope` whose `head_dim` is the width `apply` takes (DeepSeek MLA: `qk_rope_head_dim`).
    Raises:
        PosencError: unknown or non-RoPE model types, unknown rope types, missing or foreign keys, invalid values.

        >>> cfg = {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
        ...        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
        >>> rope_from_hf_config(cfg, layer_type="sliding_attention").base
        10000.0
        >>> rope_from_hf_config(cfg, layer_type="full_attention").scaling
        Linear(factor=8.0)
    """
    cfg = text_config(config_to_dict(config))
    model_type = cfg.get("model_type")
    if model_type in NON_ROPE_MODEL_TYPES:
        fail("config['model_type']", "a model that uses RoPE",
             Raw(f"{model_type!r}, which uses {NON_ROPE_MODEL_TYPES[model_type]}"))
    if model_type not in MODEL_TYPES:
        got = _MISSING if model_type is None else model_type
        fail("config['model_type']", f"one of the known RoPE model types {sorted(MODEL_TYPES)}", got)
    if model_type == "falcon" and cfg.get("alibi"):
        fail("config['alibi']", "false (this Falcon config uses ALiBi, not RoPE: see posenc.alibi_slopes)", True)
    if layer_type is not None and not isinstance(layer_type, str):
        fail("layer_type", "a layer type name such as 'full_attention', or None", layer_type)
    conv = MODEL_TYPES[model_type]
    _check_layer(cfg, model_type, conv, layer_type)
    layers, where = _layer_params(cfg, conv)
    if None in layers:
        return _build(cfg, model_type, conv, layers[None], where)
    if layer_type is not None:
        if layer_type not in layers:
            fail("layer_type", f"one of {sorted(layers)} (the layer types with rope parameters)", layer_type)
        if layers[layer_type] is None:
            fail("layer_type", "a layer type that uses RoPE (its rope parameters are null)", layer_type)
        return _build(cfg, model_type, conv, layers[layer_type], f"{where}['{layer_type}']")
    ropes = {k: _build(cfg, model_type, conv, v, f"{where}['{k}']") for k, v in layers.items() if v is not None}
    if len(set(ropes.values())) != 1:
        fail("layer_type", f"one of {sorted(ropes)} (this {model_type} config has a different RoPE per layer type)",
             None)
    return next(iter(ropes.values()))
