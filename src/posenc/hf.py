"""The only module that knows transformers' config keys and model-type conventions.

`rope_from_hf_config(cfg)` reads a `config.json` dict or a `PretrainedConfig` (transformers 4.x keys:
`rope_theta`, `rope_scaling` with `type` or `rope_type`; 5.x keys: `rope_parameters`, possibly nested
per layer type) and returns a `posenc.Rope`. Ambiguous or inconsistent configs are refused with a
`PosencError` where transformers only warns.

    >>> rope = rope_from_hf_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    ...                             "rope_theta": 500000.0})
    >>> rope.head_dim, rope.rotary_dim, rope.base, rope.pairing
    (16, 16, 500000.0, 'split_half')
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import PosencError, check_positive, fail
from .rope import scaling as sc
from .rope.spec import Rope

__all__ = ["rope_from_hf_config", "config_to_dict", "MODEL_TYPES", "ROPE_TYPES", "NON_ROPE_MODEL_TYPES"]


@dataclass(frozen=True)
class Convention:
    """How one model family applies RoPE."""

    pairing: str = "split_half"
    default_theta: float = 10000.0
    default_partial: float | None = None  # partial_rotary_factor when the config does not say
    honours_partial: bool = True  # False: the family's default rope ignores partial_rotary_factor
    mrope: bool = False


_LLAMA = Convention(honours_partial=False)
MODEL_TYPES: dict[str, Convention] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "mixtral": _LLAMA,
    "ministral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen2_moe": _LLAMA,
    "qwen3": _LLAMA,
    "qwen3_moe": _LLAMA,
    "gemma": _LLAMA,
    "gemma2": _LLAMA,
    "gemma3": Convention(honours_partial=False, default_theta=1_000_000.0),
    "gemma3_text": Convention(honours_partial=False, default_theta=1_000_000.0),
    "olmo": _LLAMA,
    "olmo2": _LLAMA,
    "starcoder2": _LLAMA,
    "granite": _LLAMA,
    "gpt_oss": Convention(honours_partial=False, default_theta=150000.0),
    "phi": Convention(default_partial=0.5),
    "phi3": Convention(),
    "stablelm": Convention(default_partial=0.25),
    "persimmon": Convention(default_partial=0.5, default_theta=25000.0),
    "gpt_neox": Convention(default_partial=0.25),
    "gptj": Convention(pairing="interleaved"),
    "falcon": _LLAMA,
    "cohere": Convention(pairing="interleaved", honours_partial=False, default_theta=500000.0),
    "glm": Convention(pairing="interleaved", default_partial=0.5),
    "deepseek_v2": Convention(pairing="interleaved", honours_partial=False),
    "deepseek_v3": Convention(pairing="interleaved_to_split_half", honours_partial=False),
    "qwen2_vl": Convention(honours_partial=False, default_theta=1_000_000.0, mrope=True),
    "qwen2_5_vl": Convention(honours_partial=False, default_theta=1_000_000.0, mrope=True),
}

NON_ROPE_MODEL_TYPES = {
    "bloom": "ALiBi (posenc.alibi_slopes / posenc.alibi_bias)",
    "mpt": "ALiBi (posenc.alibi_slopes / posenc.alibi_bias)",
    "t5": "T5 relative position buckets (posenc.t5_relative_position_bucket)",
    "mt5": "T5 relative position buckets (posenc.t5_relative_position_bucket)",
    "gpt2": "learned absolute position embeddings",
    "bert": "learned absolute position embeddings",
    "roberta": "learned absolute position embeddings",
    "distilbert": "absolute position embeddings",
}

# Keys a rope-parameter dict may carry, per rope type, beyond the common ones.
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    },
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
_ALIASES = {"mrope": "default", "su": "longrope", "ntk": "dynamic"}


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain dict from a config.json dict or a transformers `PretrainedConfig`."""
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        out = dict(to_dict())
        # Properties that to_dict() does not serialise but the model reads.
        for key in ("head_dim", "rope_parameters", "model_type"):
            if key not in out and hasattr(config, key):
                out[key] = getattr(config, key)
        return out
    fail("config", "a config.json dict or a transformers PretrainedConfig", type(config).__name__)


def _text_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """Vision-language configs keep the language model's facts in `text_config`."""
    text = cfg.get("text_config")
    if isinstance(text, Mapping) or hasattr(text, "to_dict"):
        merged = dict(config_to_dict(text))
        for key, value in cfg.items():
            merged.setdefault(key, value)
        if cfg.get("model_type"):
            merged["model_type"] = cfg["model_type"]
        return merged
    return cfg


def _number(cfg: Mapping[str, Any], key: str, where: str) -> float:
    if key not in cfg or cfg[key] is None:
        fail(f"{where}['{key}']", "a number", "nothing (key missing)")
    return check_positive(f"{where}['{key}']", cfg[key])


def _int(cfg: Mapping[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or int(value) != value:
        fail(f"{where}['{key}']", "a positive integer", value if key in cfg else "nothing (key missing)")
    return int(value)


def _rope_params(cfg: dict[str, Any], model_type: str, layer_type: str | None) -> tuple[dict[str, Any], str]:
    """The rope-parameter dict that applies, with rope_theta filled in, and a name for messages."""
    conv = MODEL_TYPES[model_type]
    params = cfg.get("rope_parameters")
    where = "rope_parameters"
    if params is None:
        params, where = cfg.get("rope_scaling"), "rope_scaling"
    params = dict(params) if params else {}
    nested = {k for k, v in params.items() if isinstance(v, Mapping)}
    layer_types = {"full_attention", "sliding_attention"} | set(cfg.get("layer_types") or [])
    if nested and nested <= layer_types:
        if layer_type is None:
            fail("layer_type", f"one of {sorted(nested)} (this config has per-layer RoPE)", None)
        if layer_type not in nested:
            fail("layer_type", f"one of {sorted(nested)}", layer_type)
        params, where = dict(params[layer_type]), f"{where}['{layer_type}']"
    elif model_type in ("gemma3", "gemma3_text"):
        # 4.x Gemma 3: rope_scaling applies to global layers; local layers use rope_local_base_freq, unscaled.
        if layer_type is None:
            fail("layer_type", "'full_attention' or 'sliding_attention' (Gemma 3 has per-layer RoPE)", None)
        if layer_type == "sliding_attention":
            params, where = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}, "rope_local_base_freq"
        elif layer_type != "full_attention":
            fail("layer_type", "'full_attention' or 'sliding_attention'", layer_type)
    elif layer_type is not None and layer_type not in (cfg.get("layer_types") or []):
        fail("layer_type", "None (this config has one RoPE for every layer)", layer_type)
    if "rope_theta" not in params or params["rope_theta"] is None:
        theta = cfg.get("rope_theta", cfg.get("rotary_emb_base", conv.default_theta))
        params["rope_theta"] = conv.default_theta if theta is None else theta
    return params, where


def _rope_type(params: Mapping[str, Any], where: str) -> str:
    t1, t2 = params.get("rope_type"), params.get("type")
    if t1 is not None and t2 is not None and _ALIASES.get(t1, t1) != _ALIASES.get(t2, t2):
        fail(f"{where}['type']", f"the same rope type as rope_type={t1!r}", t2)
    name = t1 if t1 is not None else (t2 if t2 is not None else "default")
    name = _ALIASES.get(name, name)
    if name not in _KEYS:
        fail(f"{where}['rope_type']", f"one of {ROPE_TYPES}", name)
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
            fail(f"{where}['{key}']", f"a value (required for rope_type {rope_type!r})", "nothing (key missing)")


def _head_dim(cfg: Mapping[str, Any], model_type: str) -> int:
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _int(cfg, "qk_rope_head_dim", "config")
    if cfg.get("head_dim"):
        return _int(cfg, "head_dim", "config")
    hidden = _int(cfg, "hidden_size", "config") if "hidden_size" in cfg else _int(cfg, "n_embd", "config")
    key = "num_attention_heads" if "num_attention_heads" in cfg else "n_head"
    heads = _int(cfg, key, "config")
    if hidden % heads:
        fail("config['hidden_size']", f"a multiple of {key}={heads}", hidden)
    return hidden // heads


def _rotary_dim(cfg: Mapping[str, Any], params: Mapping[str, Any], model_type: str, head_dim: int) -> int:
    conv = MODEL_TYPES[model_type]
    if model_type == "gptj":
        rotary = cfg.get("rotary_dim")
        if rotary is None:
            return 64 if head_dim >= 64 else head_dim
        return _int(cfg, "rotary_dim", "config")
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if model_type == "gpt_neox" and factor is None:
        factor = cfg.get("rotary_pct")
    if factor is None:
        factor = conv.default_partial
    if factor is None:
        return head_dim
    where = "partial_rotary_factor"
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        fail(where, "a number in (0, 1]", factor)
    if not conv.honours_partial:
        return head_dim
    rotary = int(head_dim * factor)
    if rotary % 2 or rotary == 0:
        fail(where, f"a fraction giving an even, non-zero rotary width of head_dim={head_dim}", f"{factor} -> {rotary}")
    return rotary


def _scaling(rope_type: str, p: Mapping[str, Any], cfg: Mapping[str, Any], where: str) -> sc.Scaling:
    max_pos = cfg.get("max_position_embeddings")

    def original_max() -> int:
        # transformers: a top-level original_max_position_embeddings overrides (Phi-3), else the dict's, else max_pos
        for source, key in ((cfg, "original_max_position_embeddings"), (p, "original_max_position_embeddings")):
            if source.get(key) is not None:
                return _int(source, key, "config" if source is cfg else where)
        if max_pos is None:
            fail(f"{where}['original_max_position_embeddings']", "a positive integer", "nothing (key missing)")
        return _int(cfg, "max_position_embeddings", "config")

    if rope_type == "default":
        return sc.Default()
    if rope_type == "linear":
        return sc.Linear(_number(p, "factor", where))
    if rope_type == "dynamic":
        return sc.DynamicNTK(_number(p, "factor", where), _int(cfg, "max_position_embeddings", "config"))
    if rope_type == "yarn":
        l0 = original_max()
        factor = p.get("factor")
        factor = (_int(cfg, "max_position_embeddings", "config") / l0) if factor is None else _number(p, "factor", where)
        beta_fast = p.get("beta_fast") or 32  # transformers: `or`, so 0 means unset
        beta_slow = p.get("beta_slow") or 1
        truncate = p.get("truncate", True)
        if not isinstance(truncate, bool):
            fail(f"{where}['truncate']", "true or false", truncate)
        opt = {k: (None if p.get(k) is None else check_positive(f"{where}['{k}']", p[k], allow_zero=True))
               for k in ("mscale", "mscale_all_dim")}
        attention = p.get("attention_factor")
        return sc.YaRN(
            factor=factor,
            original_max_positions=l0,
            beta_fast=check_positive(f"{where}['beta_fast']", beta_fast),
            beta_slow=check_positive(f"{where}['beta_slow']", beta_slow),
            attention_factor=None if attention is None else check_positive(f"{where}['attention_factor']", attention),
            truncate=truncate,
            **opt,
        )
    if rope_type == "longrope":
        l0 = original_max()
        factor = p.get("factor")
        if factor is None:
            factor = (max_pos / l0) if max_pos else 1.0
        factor = check_positive(f"{where}['factor']", factor)
        attention = p.get("attention_factor")
        if attention is None:
            attention = sc.LongRoPE.default_attention_factor(factor, l0)
        for key in ("short_factor", "long_factor"):
            if not isinstance(p[key], (list, tuple)):
                fail(f"{where}['{key}']", "a list of numbers", p[key])
        return sc.LongRoPE(
            short_factor=tuple(p["short_factor"]),
            long_factor=tuple(p["long_factor"]),
            original_max_positions=l0,
            attention_factor=check_positive(f"{where}['attention_factor']", attention),
        )
    if rope_type == "llama3":
        return sc.Llama3(
            factor=_number(p, "factor", where),
            low_freq_factor=_number(p, "low_freq_factor", where),
            high_freq_factor=_number(p, "high_freq_factor", where),
            original_max_positions=original_max(),
        )
    raise AssertionError(rope_type)  # unreachable: _rope_type validated the name


def rope_from_hf_config(config: Any, *, layer_type: str | None = None) -> Rope:
    """Build a `Rope` from a transformers config (dict or `PretrainedConfig`). See `Rope.from_hf_config`."""
    cfg = _text_part(config_to_dict(config))
    model_type = cfg.get("model_type")
    if model_type in NON_ROPE_MODEL_TYPES:
        fail("config['model_type']", "a model that uses RoPE", f"{model_type!r}, which uses {NON_ROPE_MODEL_TYPES[model_type]}")
    if model_type not in MODEL_TYPES:
        fail("config['model_type']", f"one of the known RoPE model types {sorted(MODEL_TYPES)}", model_type)
    if model_type == "falcon" and cfg.get("alibi"):
        fail("config['alibi']", "false (this Falcon config uses ALiBi, not RoPE: see posenc.alibi_slopes)", True)
    conv = MODEL_TYPES[model_type]
    params, where = _rope_params(cfg, model_type, layer_type)
    rope_type = _rope_type(params, where)
    _check_keys(params, rope_type, where)
    base = params["rope_theta"]
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 0:
        fail(f"{where}['rope_theta']", "a finite number > 0", base)
    head_dim = _head_dim(cfg, model_type)
    if head_dim % 2:
        fail("head_dim", "an even number of channels", head_dim)
    rotary = _rotary_dim(cfg, params, model_type, head_dim)
    scaling = _scaling(rope_type, params, cfg, where)
    pairing = conv.pairing
    if model_type == "deepseek_v3" and cfg.get("rope_interleave", True) is False:
        pairing = "split_half"
    section = params.get("mrope_section", cfg.get("mrope_section")) if conv.mrope else None
    if conv.mrope and section is None:
        section = [16, 24, 24]  # transformers' default for the Qwen2-VL family
    softmax = 1.0
    if model_type in ("deepseek_v2", "deepseek_v3") and isinstance(scaling, sc.YaRN):
        softmax = scaling.softmax_scale_factor()
    try:
        return Rope(
            head_dim=head_dim,
            rotary_dim=rotary,
            base=float(base),
            scaling=scaling,
            pairing=pairing,
            mrope_section=None if section is None else tuple(section),
            mrope_interleaved=bool(params.get("mrope_interleaved", False)),
            softmax_scale_factor=softmax,
        )
    except PosencError as e:
        raise PosencError(f"{model_type} config: {e}") from None
