"""Zero-shot length extension of the trained RoPE model with every scaling rule posenc has, and fine-tuning.

A rule is written `name` or `name:key=value,key=value` (the label keeps the spelling); for a target
length L = s * L0 it becomes a `posenc.rope.scaling` value:

| name | scaling at scale s | knobs (defaults) |
|---|---|---|
| none | `Default()` | |
| pi | `Linear(s)` (position interpolation) | |
| ntk | `NTKAware(s)` | |
| dynamic_ntk | `DynamicNTK(factor, L0)`, scored block by block through the KV cache | factor (1), block (L0) |
| yarn | `YaRN(s, L0, beta_fast, beta_slow)` with temperature 0.1 ln s + 1 | beta_fast (32), beta_slow (1), temperature (on / off / a number) |
| llama3 | `Llama3(s, low_freq_factor, high_freq_factor, L0)` | low_freq_factor (1), high_freq_factor (4) |
| longrope | `LongRoPE(ones, long_factor, L0, attention)`, factors searched per s or given | attention (paper / none / a number), factors (a/b/c: given) |

YaRN's defaults (beta_fast 32) assume L0 of thousands and head_dim 128: at L0 = 128 and head_dim 32 every
frequency gets partly interpolated, which is why `yarn:beta_fast=8` is in the default list.

    >>> rule = parse_rule("yarn:beta_fast=8,temperature=off")
    >>> s = rule.scaling(4, 128)
    >>> (type(s).__name__, s.factor, s.beta_fast, s.attention_factor)
    ('YaRN', 4.0, 8.0, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import fail
from ..rope.scaling import Default, DynamicNTK, Linear, Llama3, LongRoPE, NTKAware, YaRN

__all__ = ["Rule", "parse_rule", "RULE_KNOBS", "finetune_scaling"]

RULE_KNOBS: dict[str, dict[str, Any]] = {
    "none": {},
    "pi": {},
    "ntk": {},
    "dynamic_ntk": {"factor": 1.0, "block": None},
    "yarn": {"beta_fast": 32.0, "beta_slow": 1.0, "temperature": "on"},
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"attention": "paper", "factors": None},
}


@dataclass(frozen=True)
class Rule:
    """A named scaling rule with its knobs. `label` is how results name it."""

    name: str
    label: str
    knobs: dict[str, Any] = field(default_factory=dict)

    @property
    def length_free(self) -> bool:
        """True when one pass over the longest window serves every length (no per-length table)."""
        return self.name in ("none", "dynamic_ntk")

    @property
    def searched(self) -> bool:
        """True for LongRoPE without given factors: its factors are searched per scale."""
        return self.name == "longrope" and self.knobs["factors"] is None

    def block(self, l0: int) -> int | None:
        """Tokens per cached block when scoring (dynamic NTK), else None (one forward)."""
        if self.name != "dynamic_ntk":
            return None
        return int(self.knobs["block"] or l0)

    def scaling(self, scale: int, l0: int, long_factor: tuple[float, ...] | None = None):
        """The scaling value at target length `scale * l0` (`long_factor`: searched LongRoPE factors)."""
        s, k = float(scale), self.knobs
        if self.name == "none":
            return Default()
        if self.name == "pi":
            return Linear(s)
        if self.name == "ntk":
            return NTKAware(s)
        if self.name == "dynamic_ntk":
            return DynamicNTK(float(k["factor"]), l0)
        if self.name == "yarn":
            temperature = k["temperature"]
            factor = None if temperature == "on" else 1.0 if temperature == "off" else float(temperature)
            return YaRN(s, l0, beta_fast=float(k["beta_fast"]), beta_slow=float(k["beta_slow"]),
                        attention_factor=factor)
        if self.name == "llama3":
            return Llama3(s, float(k["low_freq_factor"]), float(k["high_freq_factor"]), l0)
        factors = long_factor if long_factor is not None else k["factors"]
        if factors is None:
            fail("long_factor", "searched or given LongRoPE factors", None)
        return LongRoPE((1.0,) * len(factors), tuple(factors), l0, attention_factor=self.attention(s, l0))

    def attention(self, scale: float, l0: int) -> float:
        """LongRoPE's attention factor: the paper's `sqrt(1 + ln s / ln L0)`, 1 ("none"), or a number."""
        value = self.knobs.get("attention", "paper")
        if value == "paper":
            return LongRoPE.default_attention_factor(scale, l0)
        return 1.0 if value == "none" else float(value)


def _value(rule: str, key: str, text: str) -> Any:
    if key == "temperature" and text in ("on", "off"):
        return text
    if key == "attention" and text in ("paper", "none"):
        return text
    if key == "factors":
        try:
            values = tuple(float(v) for v in text.split("/"))
        except ValueError:
            fail(f"{rule}:factors", "numbers separated by '/'", text)
        if any(not math.isfinite(v) or v <= 0 for v in values):
            fail(f"{rule}:factors", "positive numbers", text)
        return values
    try:
        value = float(text)
    except ValueError:
        fail(f"{rule}:{key}", "a number", text)
    if not math.isfinite(value) or value <= 0:
        fail(f"{rule}:{key}", "a finite number > 0", text)
    return int(value) if key == "block" else value


def parse_rule(spec: str, longrope_factors: tuple[float, ...] | None = None) -> Rule:
    """Parse `name` or `name:key=value,...` (see the module docstring).

    Args:
        spec: the rule text. longrope_factors: given factors for a plain `longrope` (from `--longrope-factors`).
    Raises:
        PosencError: an unknown rule or knob, or a bad value.
    """
    if not isinstance(spec, str) or not spec:
        fail("rule", f"a rule name from {tuple(RULE_KNOBS)}", spec)
    name, _, rest = spec.partition(":")
    if name not in RULE_KNOBS:
        fail("rule", f"a rule name from {tuple(RULE_KNOBS)}", spec)
    knobs = dict(RULE_KNOBS[name])
    if name == "longrope" and longrope_factors is not None:
        knobs["factors"] = tuple(float(v) for v in longrope_factors)
    for item in filter(None, rest.split(",")):
        key, eq, text = item.partition("=")
        if key not in RULE_KNOBS[name] or not eq:
            fail(f"rule {spec!r}", f"key=value knobs from {tuple(RULE_KNOBS[name]) or '(none)'}", item)
        knobs[key] = _value(name, key, text)
    if name == "yarn" and knobs["beta_fast"] <= knobs["beta_slow"]:
        fail(f"rule {spec!r}", "beta_fast > beta_slow", f"{knobs['beta_fast']} <= {knobs['beta_slow']}")
    if name == "llama3" and knobs["low_freq_factor"] >= knobs["high_freq_factor"]:
        fail(f"rule {spec!r}", "low_freq_factor < high_freq_factor", item)
    return Rule(name, spec, knobs)


def finetune_scaling(method: str, l0: int, scale: int = 2, yarn: Rule | None = None):
    """The static scaling a fine-tuning method trains and evaluates with ("none", "pi", "ntk", "yarn")."""
    if method == "none":
        return Default()
    if method == "pi":
        return Linear(float(scale))
    if method == "ntk":
        return NTKAware(float(scale))
    if method == "yarn":
        return (yarn or parse_rule("yarn")).scaling(scale, l0)
    fail("finetune_methods", "none, pi, ntk or yarn", method)
