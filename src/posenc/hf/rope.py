"""One rope-parameter dict of a transformers config -> the `posenc.Rope` transformers 5.x builds from it.

transformers 4.x keys (`rope_theta`, `rope_scaling` with `type` or `rope_type`) and 5.x keys
(`rope_parameters`) are both read; per-model facts come from the `Convention` table
(`posenc.hf.conventions`), per-layer RoPE from `posenc.hf.layers`. Ambiguous or inconsistent configs
are refused with a `PosencError` where transformers only warns.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import Raw, fail, prefix, real
from ..rope import scaling as sc
from ..rope.proportional import Proportional
from ..rope.spec import Rope
from .conventions import MISSING, Convention, config_int, head_dim, present_key

__all__ = ["ROPE_TYPES", "build_rope"]

# Keys a rope-parameter dict may carry, per rope type, beyond the common ones.
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved",
           # read by the attention, not the table (Ministral 3 / Mistral 4: Llama-4 query temperature
           # 1 + beta * log(1 + floor(position / L0)), see docs/hf.md); transformers' validation skips them too
           "llama_4_scaling_beta", "max_position_embeddings",
           "interleaved"}  # Qwen3-Omni's config class declares it (ignore_keys_at_rope_validation); nothing reads it
_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"},
    "longrope": {"short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "proportional": {"factor"},
}
_REQUIRED = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor"},
    "longrope": {"short_factor", "long_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
    "proportional": set(),
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
        fail(f"{where}['rope_type']", f"one of {conv.rope_types} (the only ones this model accepts or applies)", name)
    return name


def _check_keys(params: Mapping[str, Any], rope_type: str, where: str) -> None:
    allowed = _COMMON | _KEYS[rope_type]
    if params.get("llama_4_scaling_beta") is not None:  # Ministral 3's attention reads the temperature's step
        allowed = allowed | {"original_max_position_embeddings"}  # length there, whatever the rule (temperature.py)
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
                width: int, where: str) -> int:
    if conv.rotary_width is not None:  # a fixed rotary width (GPT-J's rotary_dim)
        key, default = conv.rotary_width
        if key in cfg and cfg[key] is None:
            fail(f"config['{key}']", "an integer (GPT-J with rotary_dim=null rotates hidden_size channels)", None)
        return config_int(cfg, key, default=default)
    if rope_type == "proportional":
        return width  # p-RoPE's table spans the head; partial_rotary_factor zeroes its upper frequencies
    if "partial_rotary_factor" in params:
        factor, arg = params["partial_rotary_factor"], f"{where}['partial_rotary_factor']"
    else:
        factor, arg = cfg.get(conv.partial_key, conv.partial), f"config['{conv.partial_key}']"
    if factor is None:
        return width
    factor = real(arg, factor, gt=0.0, le=1.0)
    if conv.rope_width is not None and conv.partial is not None:  # MLA outside the table: the factor is of head_dim
        table = int(head_dim(cfg) * factor)  # the rotary class's width: head_dim * factor, the rope slice
        if table != width:
            fail(arg, f"head_dim * factor = {conv.rope_width[0]} = {width} (the rotary class builds a table of "
                 f"head_dim * partial_rotary_factor channels for the rope slice)", Raw(f"{factor} -> {table}"))
        return width
    if conv.partial is None and rope_type == "default":
        return width  # this family's default rope ignores partial_rotary_factor
    rotary = int(width * factor)  # transformers truncates
    if conv.partial is None and rotary != width:
        fail(arg, f"1.0 for {cfg.get('model_type')} with rope_type {rope_type!r} (the model rotates the whole "
             f"head, so transformers would fail on a shorter table)", factor)
    if rotary % 2 or rotary == 0:
        fail(arg, f"a fraction giving an even, non-zero rotary width of head_dim={width}", Raw(f"{factor} -> {rotary}"))
    return rotary


def _original_max(cfg: Mapping[str, Any], p: Mapping[str, Any], conv: Convention, where: str) -> int:
    """L0 as transformers reads it: a top-level value wins over the dict's, then max_position_embeddings."""
    key = "original_max_position_embeddings"
    if cfg.get(key) is not None or conv.original_max is not None:
        # Phi3Config's class attribute (4096) is set even when config.json omits the key
        l0 = config_int(cfg, key, default=conv.original_max)
        inner = p.get(key)
        if conv.original_max is not None and inner is not None and inner != l0:
            fail(f"{where}['{key}']", f"{l0}, the top-level {key} (this model reads only that one, default "
                 f"{conv.original_max}; transformers ignores the value inside the rope dict)", inner)
        return l0
    if p.get(key) is not None:
        return config_int(p, key, where=where)
    return config_int(cfg, "max_position_embeddings", "n_positions")


def _scaling(rope_type: str, p: Mapping[str, Any], cfg: Mapping[str, Any], conv: Convention, where: str) -> sc.Scaling:
    """The scaling rule of one rope dict; the rule's own checks run, re-raised under the dict's path."""
    if rope_type == "default":
        return sc.Default()
    if rope_type == "proportional":  # transformers reads both with .get: 1.0 when absent
        with prefix(where):
            return Proportional(fraction=p.get("partial_rotary_factor", 1.0), factor=p.get("factor", 1.0))
    if conv.mscales and rope_type != "longrope":
        fail(f"{where}['rope_type']", f"'default' or 'longrope' for {cfg.get('model_type')} (its rotary multiplies "
             "cos/sin by short_mscale / long_mscale in place of the rule's attention factor; posenc models that for "
             "LongRoPE only)", rope_type)
    if rope_type in ("dynamic", "yarn", "longrope"):  # top-level keys first, outside the dict's path
        max_pos = config_int(cfg, "max_position_embeddings", "n_positions")
    if rope_type in ("yarn", "longrope", "llama3"):
        l0 = _original_max(cfg, p, conv, where)
    with prefix(where, rename={"original_max_positions": "original_max_position_embeddings"}):
        if rope_type == "linear":
            return sc.Linear(p["factor"])
        if rope_type == "dynamic":
            return sc.DynamicNTK(p["factor"], max_pos)
        if rope_type == "llama3":
            return sc.Llama3(factor=p["factor"], low_freq_factor=p["low_freq_factor"],
                             high_freq_factor=p["high_freq_factor"], original_max_positions=l0)
        # transformers' default factor is max_position_embeddings / L0
        factor = max_pos / l0 if p.get("factor") is None else real("factor", p["factor"], gt=0.0)
        if rope_type == "yarn":  # transformers reads beta_fast `or 32`, beta_slow `or 1`: 0 means unset
            return sc.YaRN(factor=factor, original_max_positions=l0, beta_fast=p.get("beta_fast") or 32.0,
                           beta_slow=p.get("beta_slow") or 1.0, mscale=p.get("mscale"),
                           mscale_all_dim=p.get("mscale_all_dim"), attention_factor=p.get("attention_factor"),
                           truncate=p.get("truncate", True))
        if conv.mscales:
            return _mscaled_longrope(p, l0)
        attention = p.get("attention_factor")  # longrope
        if attention is None:
            attention = sc.LongRoPE.default_attention_factor(factor, l0)
        return sc.LongRoPE(short_factor=p["short_factor"], long_factor=p["long_factor"], original_max_positions=l0,
                           attention_factor=attention)


def _mscaled_longrope(p: Mapping[str, Any], l0: int) -> sc.LongRoPE:
    """Phi-MoE's LongRoPE (PhimoeRotaryEmbedding, transformers 5.x): its table is built without a length, so the
    short factors at every length, times short_mscale up to L0 and long_mscale beyond (by each call's largest
    position). posenc's LongRoPE has one attention factor: the two mscales must be equal (as Phi-3.5-MoE's are)."""
    short, long = (real(key, p.get(key, MISSING), gt=0.0) for key in ("short_mscale", "long_mscale"))
    if short != long:
        fail("long_mscale", f"short_mscale = {short} (the model switches the cos/sin multiplier at L0 = {l0} call by "
             "call; posenc's LongRoPE has one attention factor)", long)
    return sc.LongRoPE(short_factor=p["short_factor"], long_factor=p["short_factor"], original_max_positions=l0,
                       attention_factor=short)


def _hw_alternating(section: Any, where: str) -> list[int]:
    """Ernie 4.5 VL's [s_h, s_w, s_t] as posenc sections (block k follows axis k % 3): h, w alternate over the first
    2 s_h frequencies, t drives the last s_t: `(0, 1, 1) * s_h + (s_t,)`. Its modeling code pre-permutes the
    ladder so that frequency j keeps its own `inv_freq[j]`; only the axis map is its own."""
    if len(section) != 3 or not all(isinstance(n, int) and n >= 0 for n in section) or section[0] != section[1] \
            or section[2] == 0:
        fail(f"{where}['mrope_section']", "3 integers [s_h, s_w, s_t] with s_h == s_w and s_t >= 1 (Ernie 4.5 VL "
             "alternates h and w frequencies pair by pair; its code slices inv_freq[:-s_t], empty for 0)", section)
    return [0, 1, 1] * section[0] + [section[2]]


# HunYuan's "dynamic" with `alpha`: keys its checkpoints carry that its NTK-alpha table never reads
_NTK_ALPHA_UNREAD = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _ntk_alpha(params: Mapping[str, Any], where: str) -> sc.NTKAware:
    """HunYuan's static NTK-alpha (its "dynamic" label with a fixed `alpha`): base * alpha**(d / (d - 2))."""
    _check_keys({k: v for k, v in params.items() if k not in ("alpha", *_NTK_ALPHA_UNREAD)}, "default", where)
    with prefix(where, rename={"factor": "alpha"}):
        return sc.NTKAware(params["alpha"])


def build_rope(cfg: dict[str, Any], conv: Convention, params: Mapping[str, Any], where: str) -> Rope:
    """The `Rope` of one rope-parameter dict `params` (found at `where`) of the text config `cfg`."""
    rope_type = rope_type_of(params, where, conv)
    ntk_alpha = conv.ntk_alpha and rope_type == "dynamic" and params.get("alpha") not in (None, 0)
    if not ntk_alpha:
        mscales = ("short_mscale", "long_mscale") if conv.mscales and rope_type != "default" else ()
        _check_keys({k: v for k, v in params.items() if k not in mscales}, rope_type, where)
    if conv.fixed_table:  # GPT-J's table is hard-wired: base 10000, unscaled (rope_types refuses any scaling)
        theta = params.get("rope_theta", cfg.get(conv.theta_key))
        if theta not in (None, conv.default_theta):
            fail(f"config['{conv.theta_key}']", f"{conv.default_theta} or no key ({cfg['model_type']}'s table is "
                 "fixed: transformers ignores the key)", theta)
    base, where_theta = params.get("rope_theta"), f"{where}['rope_theta']"
    if base is None:
        base, where_theta = cfg.get(conv.theta_key), f"config['{conv.theta_key}']"
        base = conv.default_theta if base is None else base
    base = real(where_theta, base, gt=0.0)
    if base == 1:
        fail(where_theta, "a number other than 1 (every frequency would be 1)", base)
    if conv.rope_width is not None:  # MLA: RoPE runs on a narrower slice of each head
        key, default = conv.rope_width
        width = config_int(cfg, key, default=default)
    else:
        width = head_dim(cfg)
    if width % 2:
        fail("head_dim", "an even number of channels (RoPE rotates pairs)", width)
    rotary = _rotary_dim(cfg, params, rope_type, conv, width, where)
    scaling = _ntk_alpha(params, where) if ntk_alpha else _scaling(rope_type, params, cfg, conv, where)
    pairing = conv.pairing
    flag = cfg.get("rope_interleave") if conv.reads_rope_interleave else None  # (DeepSeek-V3.2 ignores it)
    if pairing == "interleaved_to_split_half" and flag is False:
        pairing = "split_half"  # DeepSeek-V3 with rope_interleave=false
    if conv.rope_width is not None and pairing == "split_half" and flag is True:
        pairing = "interleaved_to_split_half"  # another MLA family with DeepSeek-V3's flag set
    section = None
    if conv.mrope:  # the family's layout; the Qwen2-VL family ignores mrope_interleaved (only Qwen3-VL interleaves)
        section = params.get("mrope_section", cfg.get("mrope_section")) or list(conv.mrope_default)
        if not isinstance(section, (list, tuple)):
            fail(f"{where}['mrope_section']", "a list of 3 integers (t, h, w frequencies)", section)
        if conv.mrope_interleaved and len(section) == 3 and all(isinstance(n, int) for n in section) \
                and sum(section) < rotary // 2:
            # interleaved: only s_h and s_w are read; every other frequency follows T (Qwen4-exp's default
            # [11, 11, 10] on a 256-channel head)
            section = [rotary // 2 - section[1] - section[2], section[1], section[2]]
        if conv.mrope_hw_alternating:
            section = _hw_alternating(section, where)
    softmax = 1.0
    if conv.rope_width is not None and isinstance(scaling, sc.YaRN):  # DeepSeek's softmax mscale
        softmax = scaling.softmax_scale_factor()
    with prefix(where):  # head_dim, rotary_dim and base are checked above: what fails here is the dict's
        return Rope(head_dim=width, rotary_dim=rotary, base=base, scaling=scaling, pairing=pairing,
                    mrope_section=None if section is None else tuple(section),
                    mrope_interleaved=section is not None and conv.mrope_interleaved, softmax_scale_factor=softmax,
                    direction=conv.direction)
