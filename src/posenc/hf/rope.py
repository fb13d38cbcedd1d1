"""One rope-parameter dict of a transformers config -> the `posenc.Rope` transformers 5.x builds from it.

transformers 4.x keys (`rope_theta`, `rope_scaling` with `type` or `rope_type`) and 5.x keys
(`rope_parameters`) are both read; per-model facts come from the `Convention` table
(`posenc.hf.conventions`), per-layer RoPE from `posenc.hf.layers`. Ambiguous or inconsistent configs
are refused with a `PosencError` where transformers only warns.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..errors import PosencError, Raw, check_positive, fail
from ..rope import scaling as sc
from ..rope.spec import Rope
from .conventions import MISSING, Convention, config_int, head_dim, present_key

__all__ = ["ROPE_TYPES", "build_rope"]

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


def rope_type_of(params: Mapping[str, Any], where: str, conv: Convention) -> str:
    """The rope type a parameter dict names (`rope_type`, or the legacy `type`), after the family's aliases."""
    aliases = dict(conv.aliases)
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
    if conv.rope_types is not None and name not in conv.rope_types:
        fail(f"{where}['rope_type']", f"one of {conv.rope_types} (the only ones this model accepts)", name)
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
            fail(f"{where}['{key}']", f"a value (required for rope_type {rope_type!r})", MISSING)


def _rotary_dim(cfg: Mapping[str, Any], params: Mapping[str, Any], rope_type: str, conv: Convention,
                width: int) -> int:
    if conv.rotary_width is not None:  # a fixed rotary width (GPT-J's rotary_dim)
        key, default = conv.rotary_width
        if key in cfg and cfg[key] is None:
            fail(f"config['{key}']", "an integer (GPT-J with rotary_dim=null rotates hidden_size channels)", None)
        return config_int(cfg, key, default=default)
    factor = params.get("partial_rotary_factor", cfg.get(conv.partial_key, conv.partial))
    where = "partial_rotary_factor"
    if factor is None:
        return width
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        fail(where, "a number in (0, 1]", factor)
    if conv.partial is None and rope_type == "default":
        return width  # this family's default rope ignores partial_rotary_factor
    rotary = int(width * factor)  # transformers truncates
    if conv.partial is None and rotary != width:
        fail(where, f"1.0 for {cfg.get('model_type')} with rope_type {rope_type!r} (the model rotates the whole "
             f"head, so transformers would fail on a shorter table)", factor)
    if rotary % 2 or rotary == 0:
        fail(where, f"a fraction giving an even, non-zero rotary width of head_dim={width}", Raw(f"{factor} -> {rotary}"))
    return rotary


def _original_max(cfg: Mapping[str, Any], p: Mapping[str, Any], conv: Convention, where: str) -> int:
    """L0 as transformers reads it: a top-level value wins over the dict's, then max_position_embeddings."""
    top = cfg.get("original_max_position_embeddings")
    if top is None and conv.original_max is not None:
        top = conv.original_max  # Phi3Config's class attribute (4096): set even when config.json omits it
    if top is not None:
        l0 = config_int({"original_max_position_embeddings": top}, "original_max_position_embeddings")
        inner = p.get("original_max_position_embeddings")
        if conv.original_max is not None and inner is not None and inner != l0:
            fail(f"{where}['original_max_position_embeddings']",
                 f"{l0}, the top-level original_max_position_embeddings (this model reads only that one, default "
                 f"{conv.original_max}; transformers ignores the value inside the rope dict)", inner)
        return l0
    if p.get("original_max_position_embeddings") is not None:
        return config_int(p, "original_max_position_embeddings", where=where)
    return config_int(cfg, "max_position_embeddings", "n_positions")


def _scaling(rope_type: str, p: Mapping[str, Any], cfg: Mapping[str, Any], conv: Convention, where: str) -> sc.Scaling:
    def number(key: str, default: Any = None) -> float:
        value = p.get(key, default)
        if value is None:
            fail(f"{where}['{key}']", "a number", MISSING)
        return check_positive(f"{where}['{key}']", value)

    def max_pos() -> int:
        return config_int(cfg, "max_position_embeddings", "n_positions")

    if rope_type == "default":
        return sc.Default()
    if rope_type == "linear":
        return sc.Linear(number("factor"))
    if rope_type == "dynamic":
        return sc.DynamicNTK(number("factor"), max_pos())
    if rope_type == "llama3":
        low, high = number("low_freq_factor"), number("high_freq_factor")
        if low >= high:
            fail(f"{where}['low_freq_factor']", f"a value below high_freq_factor={high}", low)
        return sc.Llama3(factor=number("factor"), low_freq_factor=low, high_freq_factor=high,
                         original_max_positions=_original_max(cfg, p, conv, where))
    l0 = _original_max(cfg, p, conv, where)
    factor = max_pos() / l0 if p.get("factor") is None else number("factor")  # transformers' default factor
    if rope_type == "yarn":
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
    attention = p.get("attention_factor")  # longrope
    if attention is None:
        attention = sc.LongRoPE.default_attention_factor(factor, l0)
    for key in ("short_factor", "long_factor"):
        if not isinstance(p[key], (list, tuple)):
            fail(f"{where}['{key}']", "a list of numbers, one per rotation pair", p[key])
    return sc.LongRoPE(short_factor=tuple(p["short_factor"]), long_factor=tuple(p["long_factor"]),
                       original_max_positions=l0, attention_factor=check_positive(f"{where}['attention_factor']", attention))


def build_rope(cfg: dict[str, Any], conv: Convention, params: Mapping[str, Any], where: str) -> Rope:
    """The `Rope` of one rope-parameter dict `params` (found at `where`) of the text config `cfg`."""
    rope_type = rope_type_of(params, where, conv)
    if conv.fixed_table:  # GPT-J's table is hard-wired: base 10000, no scaling
        params, rope_type = {"rope_theta": 10000.0}, "default"
    _check_keys(params, rope_type, where)
    base, where_theta = params.get("rope_theta"), f"{where}['rope_theta']"
    if base is None:
        base, where_theta = cfg.get(conv.theta_key), f"config['{conv.theta_key}']"
        base = conv.default_theta if base is None else base
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 0:
        fail(where_theta, "a finite number > 0", base)
    if base == 1:
        fail(where_theta, "a number other than 1 (every frequency would be 1)", base)
    if conv.rope_width is not None:  # MLA: RoPE runs on a narrower slice of each head
        key, default = conv.rope_width
        width = config_int(cfg, key, default=default)
    else:
        width = head_dim(cfg)
    if width % 2:
        fail("head_dim", "an even number of channels (RoPE rotates pairs)", width)
    rotary = _rotary_dim(cfg, params, rope_type, conv, width)
    scaling = _scaling(rope_type, params, cfg, conv, where)
    pairing = conv.pairing
    if pairing == "interleaved_to_split_half" and cfg.get("rope_interleave", True) is False:
        pairing = "split_half"  # DeepSeek-V3 with rope_interleave=false
    section = None
    if conv.mrope:  # sectioned; the Qwen2-VL family ignores mrope_interleaved (only Qwen3-VL interleaves)
        section = params.get("mrope_section", cfg.get("mrope_section")) or [16, 24, 24]  # transformers' default
        if not isinstance(section, (list, tuple)):
            fail(f"{where}['mrope_section']", "a list of 3 integers (t, h, w frequencies)", section)
    softmax = 1.0
    if conv.rope_width is not None and isinstance(scaling, sc.YaRN):  # DeepSeek's softmax mscale
        softmax = scaling.softmax_scale_factor()
    try:
        return Rope(head_dim=width, rotary_dim=rotary, base=float(base), scaling=scaling, pairing=pairing,
                    mrope_section=None if section is None else tuple(section), softmax_scale_factor=softmax)
    except PosencError as e:
        raise PosencError(f"{cfg.get('model_type')} config: {e}") from None
